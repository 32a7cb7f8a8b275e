// replay_buffer: one producer process pushes transitions into a shared slot
// buffer while two sampler processes draw random batches from it.
//
// The parent creates the buffer (<spindle/slots.h>: a sealed memfd of
// fixed-size slots, one seqlock word per slot) and forks three children.
// Everything between them is a typed call: `attach` passes the buffer's
// memfd as an fd argument (a spindle::UniqueFd parameter: SCM_RIGHTS on the
// child's link), `run` works until `stop` and returns the child's counts
// (pushes; samples, torn reads, busy or empty slots). The children serve on
// a Pool of two threads, so that `stop` runs while `run` still does. The
// records themselves never touch a socket: they go through shared memory.
//
// Each transition carries a checksum of its fields; a sampler that ever saw
// a record whose checksum fails reports it as torn. The program exits 0 only
// if no torn read was seen, the producer pushed, both samplers sampled and
// every child exited 0.
#include <sys/wait.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <future>
#include <mutex>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <spindle/spindle.h>

namespace {

constexpr std::size_t kSlots = 4096;
constexpr std::size_t kBatch = 32;
constexpr auto kRunFor = std::chrono::milliseconds(1500);

// One environment step: ints and arrays, a fixed layout shared by every process.
struct Transition {
  static constexpr std::uint32_t kLayoutId = 1;
  std::uint64_t step;
  std::int32_t action;
  std::int32_t done;
  float reward;
  float observation[32];
  float next_observation[32];
  std::uint64_t checksum;  // of every byte before it
};
using Slots = spindle::RecordSlots<Transition>;

// What a child did between run and stop.
struct Counts {
  std::uint64_t pushes = 0, busy = 0;                           // producer
  std::uint64_t samples = 0, batches = 0, torn = 0, skipped = 0;  // samplers
  MSGPACK_DEFINE_MAP(pushes, busy, samples, batches, torn, skipped)
};

// The child's end of the buffer (taken, not copied: the child owns the fd).
inline constexpr spindle::method<std::string(spindle::UniqueFd)> attach{"replay.attach"};
inline constexpr spindle::method<Counts()> run{"replay.run"};  // until stop
inline constexpr spindle::method<void()> stop{"replay.stop"};

std::uint64_t checksum_of(const Transition& t) {
  std::uint64_t h = 1469598103934665603ull;  // FNV-1a
  const auto* p = reinterpret_cast<const unsigned char*>(&t);
  for (std::size_t i = 0; i < offsetof(Transition, checksum); ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

Transition make_transition(std::uint64_t step) {
  Transition t{};
  t.step = step;
  t.action = static_cast<std::int32_t>(step % 7);
  t.done = step % 100 == 99;
  t.reward = static_cast<float>(step % 13) * 0.25f;
  for (int i = 0; i < 32; ++i) {
    t.observation[i] = static_cast<float>(step + static_cast<std::uint64_t>(i));
    t.next_observation[i] = static_cast<float>(step + static_cast<std::uint64_t>(i) + 1);
  }
  t.checksum = checksum_of(t);
  return t;
}

// --- Children -----------------------------------------------------------------
enum class Role { kProducer, kSampler };

Counts produce(Slots& slots, const std::atomic<bool>& stopping) {
  Counts c;
  while (!stopping.load(std::memory_order_acquire)) {
    if (slots.push(make_transition(c.pushes)).status == spindle::SlotStatus::kOk) ++c.pushes;
    else ++c.busy;
  }
  return c;
}

Counts sample(Slots& slots, const std::atomic<bool>& stopping, std::uint32_t seed) {
  Counts c;
  std::mt19937_64 rng(seed);
  Transition t;
  while (!stopping.load(std::memory_order_acquire)) {
    std::size_t filled = slots.filled();
    if (filled == 0) {
      std::this_thread::yield();
      continue;
    }
    for (std::size_t i = 0; i < kBatch; ++i) {
      if (slots.read(rng() % filled, t) != spindle::SlotStatus::kOk) {
        ++c.skipped;  // busy (being written) or not yet written: draw another time
        continue;
      }
      if (t.checksum != checksum_of(t) || t.observation[0] != static_cast<float>(t.step)) ++c.torn;
      ++c.samples;
    }
    ++c.batches;
  }
  return c;
}

int child_main(spindle::ChildEnv& env, Role role) {
  std::mutex mu;
  std::optional<Slots> slots;  // under mu until run() takes it
  std::atomic<bool> stopping{false};
  env.expose(attach, [&](spindle::UniqueFd fd) {
    Slots s = Slots::attach(std::move(fd));  // throws for a wrong layout: the parent gets CallError
    std::string text = std::to_string(s.slot_count()) + " slots of " + std::to_string(sizeof(Transition)) + " bytes";
    std::lock_guard lk(mu);
    slots.emplace(std::move(s));
    return text;
  });
  env.expose(run, [&] {
    std::unique_lock lk(mu);
    if (!slots) throw std::logic_error("run before attach");
    Slots& s = *slots;
    lk.unlock();
    return role == Role::kProducer ? produce(s, stopping) : sample(s, stopping, env.id());
  });
  env.expose(stop, [&] { stopping.store(true, std::memory_order_release); });
  return env.serve(spindle::Pool{.threads = 2});  // stop() runs while run() does
}

}  // namespace

int main() {
  spindle::Runtime rt({.name = "trainer"});
  Slots slots = Slots::create(kSlots);

  std::vector<spindle::Child> children;
  children.push_back(rt.fork_child([](spindle::ChildEnv& e) { return child_main(e, Role::kProducer); },
                                   {.name = "producer"}));
  for (int i = 0; i < 2; ++i)
    children.push_back(rt.fork_child([](spindle::ChildEnv& e) { return child_main(e, Role::kSampler); },
                                     {.name = "sampler-" + std::to_string(i)}));

  int failures = 0;
  try {
    // Each child gets a duplicate of the buffer's fd; ours stays ours.
    for (auto& c : children)
      std::printf("%-10s attached: %s\n", c.name().c_str(),
                  c.call(attach, spindle::dup_fd(slots.buffer().fd())).c_str());
    std::vector<std::future<Counts>> reports;
    for (auto& c : children) reports.push_back(c.call_async(run));
    std::this_thread::sleep_for(kRunFor);
    for (auto& c : children) c.call(stop);
    std::uint64_t torn = 0;
    for (std::size_t i = 0; i < children.size(); ++i) {
      Counts r = reports[i].get();
      if (i == 0)
        std::printf("%-10s pushes=%llu busy=%llu\n", children[i].name().c_str(),
                    static_cast<unsigned long long>(r.pushes), static_cast<unsigned long long>(r.busy));
      else
        std::printf("%-10s samples=%llu batches=%llu torn=%llu skipped=%llu\n", children[i].name().c_str(),
                    static_cast<unsigned long long>(r.samples), static_cast<unsigned long long>(r.batches),
                    static_cast<unsigned long long>(r.torn), static_cast<unsigned long long>(r.skipped));
      torn += r.torn;
      bool worked = i == 0 ? r.pushes > 0 : r.samples > 0;
      if (!worked) ++failures;
    }
    std::printf("torn reads: %llu\n", static_cast<unsigned long long>(torn));
    if (torn != 0) ++failures;
  } catch (const std::exception& e) {
    std::printf("replay_buffer failed: %s\n", e.what());
    ++failures;
  }
  for (auto& c : children) {
    int st = c.stop();  // SHUTDOWN, grace, SIGKILL if need be, reap
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      std::printf("%s: wait status %d\n", c.name().c_str(), st);
      ++failures;
    }
  }
  return failures == 0 ? 0 : 1;
}
