// stream_values: a child streams values to its parent's Receiver through a
// Sender, in batches (docs/GUIDE.md sections 5 and 8, "Sending a burst").
//
// A SendBatch around each burst hands it to the child's broker thread with
// one wake-up; without it, a thread that sends faster than the broker writes
// wakes it again each time it has caught up. The parent checks that every
// value arrived, in order.
#include <algorithm>
#include <chrono>
#include <cstdio>

#include <spindle/spindle.h>

inline constexpr spindle::method<long(spindle::Sender<long>, long, long)> count_to{"count_to"};

int child_main(spindle::ChildEnv& env) {
  // Sends 1..n to `to`, `per_batch` values to a batch; returns how many.
  env.expose(count_to, [](spindle::Sender<long> to, long n, long per_batch) {
    for (long i = 1; i <= n;) {
      spindle::SendBatch batch(to.context());
      for (long end = std::min(n, i + per_batch - 1); i <= end; ++i) to.send(i);
    }  // each batch leaves here, in one write
    return n;
  });
  return env.serve();
}

int main() {
  constexpr long kValues = 100'000, kPerBatch = 1'000;
  spindle::Runtime rt;
  spindle::Child child = rt.fork_child(child_main);
  spindle::Receiver<long> rx(rt);
  // Received while the call runs: what waits in the Receiver is bounded
  // (its sender waits at the high-water mark), so the parent must read.
  auto done = child.call_async(count_to, rx.sender(), kValues, kPerBatch);
  long wrong = 0;
  for (long expected = 1; expected <= kValues; ++expected) {
    auto v = rx.receive_for(std::chrono::seconds(30));
    if (!v) {
      std::printf("value %ld of %ld did not arrive\n", expected, kValues);
      return 1;
    }
    if (*v != expected) ++wrong;
  }
  const long sent = done.get();
  std::printf("%ld values streamed in batches of %ld, %ld out of order\n", sent, kPerBatch, wrong);
  return sent == kValues && wrong == 0 ? 0 : 1;
}
