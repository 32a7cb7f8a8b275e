// bench_queues: the send queue's structure beside Boost.Lockfree, in the
// same run. Issue #12 names Boost.Lockfree for the cross-thread queues and
// asks for a structure of our own only where a bench row shows Boost.Lockfree
// losing; this is that row for the Outbox (router/outbox.h), the queue every
// send from an application thread goes through.
//
// Both carry the same thing, a send's routing record (OutboxRecord) plus a
// 64-byte body, from P producer threads to one consumer thread that copies
// each body out (as the broker copies it into a stream's TxQueue):
//   outbox    the Outbox itself: a producer reserves with one CAS on the
//             tail and writes record and body in place; the consumer drains
//             in batches and zeroes what it consumed.
//   lockfree  boost::lockfree::queue<Node*> (fixed capacity) of nodes that
//             come from a boost::lockfree::stack<Node*> free list filled
//             once: no allocation per message, as the Outbox has none; a
//             producer pops a free node, fills it and pushes it, the
//             consumer pops it, copies the body out and pushes the node back.
// Wake-ups are left out of both (the consumer spins): they are the same
// coalesced eventfd write in either design, and here the structures alone
// are compared. Floor: one thread writing the same records into a buffer and
// reading them back, with no second thread (what the copying costs).
//
// Usage: bench_queues [--quick] [--json PATH]
// Exit status non-zero if a message is lost or corrupted, never on a figure.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <boost/lockfree/queue.hpp>
#include <boost/lockfree/stack.hpp>
#include <fmt/format.h>

#include "bench/report.h"
#include "router/outbox.h"

namespace {

using Clock = std::chrono::steady_clock;
using spindle::Outbox;
using spindle::OutboxRecord;

constexpr std::size_t kBody = 64;
constexpr std::size_t kNodes = 16384;  // the lock-free queue's capacity and its free list

struct Node {
  OutboxRecord rec;
  std::uint8_t body[kBody];
};

// What the consumer checks: every producer's sequence arrives whole and in
// its order (the body holds producer and sequence number).
struct Check {
  std::vector<std::uint64_t> next;
  std::uint64_t errors = 0, got = 0;
  explicit Check(int producers) : next(static_cast<std::size_t>(producers), 0) {}
  void take(const std::uint8_t* body) {
    std::uint64_t who, seq;
    std::memcpy(&who, body, 8);
    std::memcpy(&seq, body + 8, 8);
    if (who >= next.size() || seq != next[who]) ++errors;
    else ++next[who];
    ++got;
  }
};

void fill(std::uint8_t* body, std::uint64_t who, std::uint64_t seq) {
  std::memcpy(body, &who, 8);
  std::memcpy(body + 8, &seq, 8);
  std::memset(body + 16, 0x5a, kBody - 16);
}

// Messages per second through `push`/`drain` with `producers` threads of
// `per` messages each; throws if one went missing or came out of order.
template <class Push, class Drain>
double run(int producers, std::uint64_t per, Push push, Drain drain) {
  Check check(producers);
  const std::uint64_t total = per * static_cast<std::uint64_t>(producers);
  std::atomic<bool> go{false};
  std::vector<std::thread> ts;
  for (int p = 0; p < producers; ++p)
    ts.emplace_back([&, p] {
      while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
      std::uint8_t body[kBody];
      for (std::uint64_t i = 0; i < per; ++i) {
        fill(body, static_cast<std::uint64_t>(p), i);
        while (!push(body)) std::this_thread::yield();  // full: let the consumer run
      }
    });
  const auto t0 = Clock::now();
  go.store(true, std::memory_order_release);
  while (check.got < total)
    if (drain(check) == 0) std::this_thread::yield();
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  for (auto& t : ts) t.join();
  if (check.errors) throw std::runtime_error(fmt::format("{} messages lost or out of order", check.errors));
  return static_cast<double>(total) / s;
}

double outbox_rate(int producers, std::uint64_t per) {
  Outbox box;
  OutboxRecord rec;
  rec.header.handle = 7;
  return run(
      producers, per,
      [&](const std::uint8_t* body) {
        return box.push(rec, {body, kBody}, nullptr, std::chrono::milliseconds(0)) == Outbox::Push::kOk;
      },
      [&](Check& c) {
        return box.drain([&](OutboxRecord&, std::span<const std::uint8_t> bytes, spindle::Message*) {
          std::uint8_t out[kBody];
          std::memcpy(out, bytes.data(), kBody);
          c.take(out);
        });
      });
}

double lockfree_rate(int producers, std::uint64_t per) {
  std::vector<Node> nodes(kNodes);
  boost::lockfree::stack<Node*> free_list(kNodes);
  boost::lockfree::queue<Node*> queue(kNodes);
  for (Node& n : nodes) free_list.unsynchronized_push(&n);
  return run(
      producers, per,
      [&](const std::uint8_t* body) {
        Node* n = nullptr;
        if (!free_list.pop(n)) return false;
        n->rec.header.handle = 7;
        std::memcpy(n->body, body, kBody);
        while (!queue.push(n)) std::this_thread::yield();
        return true;
      },
      [&](Check& c) {
        std::size_t handled = 0;
        Node* n = nullptr;
        while (queue.pop(n)) {
          std::uint8_t out[kBody];
          std::memcpy(out, n->body, kBody);
          free_list.push(n);
          c.take(out);
          ++handled;
        }
        return handled;
      });
}

// One thread, no hand-off: the same records written into a buffer and read
// back, a buffer's worth at a time.
double floor_rate(std::uint64_t total) {
  std::vector<Node> buf(kNodes);
  Check check(1);
  const auto t0 = Clock::now();
  for (std::uint64_t i = 0; i < total;) {
    const std::uint64_t batch = std::min<std::uint64_t>(kNodes, total - i);
    for (std::uint64_t k = 0; k < batch; ++k) {
      buf[k].rec.header.handle = 7;
      fill(buf[k].body, 0, i + k);
    }
    for (std::uint64_t k = 0; k < batch; ++k) {
      std::uint8_t out[kBody];
      std::memcpy(out, buf[k].body, kBody);
      check.take(out);
    }
    i += batch;
  }
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  if (check.errors) throw std::runtime_error("the floor's records came back wrong");
  return static_cast<double>(total) / s;
}

int usage(const char* argv0) {
  std::fprintf(stderr, "usage: %s [--quick] [--json PATH]\n", argv0);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  spindle::bench::Report report("bench_queues");
  bool quick = false;
  try {
    report.take_args(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_queues: %s\n", e.what());
    return usage(argv[0]);
  }
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) quick = true;
    else return usage(argv[0]);
  }
  const std::uint64_t total = quick ? 400'000 : 8'000'000;
  try {
    std::printf("bench_queues: %llu messages of %zu B (+ a %zu-byte record) per run, %u CPUs\n",
                static_cast<unsigned long long>(total), kBody, sizeof(OutboxRecord),
                std::thread::hardware_concurrency());
    const double floor = floor_rate(total);
    std::printf("floor (one thread, no hand-off): %.1f M msgs/s\n", floor / 1e6);
    std::printf("%-10s %14s %14s %10s\n", "producers", "outbox", "lockfree", "ratio");
    for (int p : {1, 2, 4}) {
      const std::uint64_t per = total / static_cast<std::uint64_t>(p);
      // Alternated, best of two each: the machine's other load falls on both.
      double ob = 0, lf = 0;
      for (int round = 0; round < 2; ++round) {
        ob = std::max(ob, outbox_rate(p, per));
        lf = std::max(lf, lockfree_rate(p, per));
      }
      std::printf("%-10d %11.2f M/s %11.2f M/s %9.2fx\n", p, ob / 1e6, lf / 1e6, ob / lf);
      report.add(fmt::format("queue_outbox_64B_{}p", p), ob, "msgs/s", floor);
      report.add(fmt::format("queue_lockfree_64B_{}p", p), lf, "msgs/s", floor);
      report.add(fmt::format("queue_outbox_over_lockfree_{}p", p), ob / lf, "x");
    }
    std::printf("\n");
    report.finish();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_queues: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
