// Pairs: N sender -> receiver pairs of clients of one router, for
// bench_router's throughput rows. Each pair is two spindle::Connections (each
// with its own broker thread); run() sends per-pair sequence numbers from up
// to 4 threads (the senders taken in turn) with Router::send, each turn in
// one SendBatch when asked (api/send_batch.h: as the raw floor writes a turn
// in one writev), and every receiver checks the sender, the sequence and the
// size of what arrives.
//
// Thread safety: construct, run() and destroy on one thread (not a broker
// thread); the receivers' handlers run on their broker threads.
// Ownership: owns its connections; the router they connect to must outlive it.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "router/connect.h"
#include "spindle/send_batch.h"

namespace spindle::bench {

inline constexpr std::uint32_t kPairsHandle = 2401;
inline constexpr std::size_t kPairsMessageSize = 64;
inline constexpr int kPairsMaxSenderThreads = 4;
inline constexpr const char* kErrPairsLost = "not every message arrived within 120 s";
inline constexpr const char* kErrPairsBad =
    "messages arrived corrupted, from the wrong sender or out of order";

// What one receiver has seen; its handler runs on that client's broker thread.
struct alignas(64) Inbox {
  std::atomic<std::uint32_t> from{0};     // the partner's context id
  std::atomic<std::uint64_t> target{0};   // received count at which this run is done
  std::atomic<std::uint64_t> errors{0};
  std::atomic<bool> stall{false};         // hold the run's first message (run())
  std::uint64_t next = 0, got = 0;        // the broker thread only
};

// N sender -> receiver pairs of clients of one router.
class Pairs {
 public:
  Pairs(const UnixAddress& address, int n) {
    for (int i = 0; i < n; ++i) {
      inboxes_.push_back(std::make_unique<Inbox>());
      Inbox& box = *inboxes_.back();
      auto r = std::make_unique<Connection>(RouterOptions{.name = fmt::format("recv-{}", i)});
      r->router().add_handler([this, &box](Message&& m) { on_message(box, m); }, {}, kPairsHandle);
      r->connect(address);
      auto s = std::make_unique<Connection>(RouterOptions{.name = fmt::format("send-{}", i)});
      s->connect(address);
      box.from.store(s->id());
      to_.push_back(s->context(r->id()));
      receivers_.push_back(std::move(r));
      senders_.push_back(std::move(s));
    }
  }
  ~Pairs() {
    for (auto& c : senders_) c->close();
    for (auto& c : receivers_) c->close();
  }

  // Each sender sends `per_pair` messages to its partner, `per_turn` at a
  // time before its thread turns to the next sender (the relay floor's
  // writers take their pairs the same way); returns the seconds from the
  // first send to the last receipt. Throws if any is lost or wrong. With
  // `batched`, each turn is sent in one SendBatch.
  // With `stall`, each receiver's broker thread sleeps that long on its first
  // message, so that the queues on the way fill to their high-water marks
  // (given enough messages to fill them: the sockets' buffers first).
  double run(std::uint64_t per_pair, std::uint64_t per_turn, bool batched,
             std::chrono::milliseconds stall = std::chrono::milliseconds(0)) {
    stall_ = stall;
    const int n = static_cast<int>(senders_.size());
    {
      std::lock_guard lk(mu_);
      finished_ = false;
    }
    remaining_.store(n);
    for (auto& b : inboxes_) {
      b->target.store(sent_ + per_pair);
      b->stall.store(stall.count() > 0);
    }
    std::exception_ptr error;
    std::mutex error_mu;
    const int threads = std::min(n, kPairsMaxSenderThreads);
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t)
      ts.emplace_back([&, t] {
        try {
          std::uint8_t body[kPairsMessageSize];
          std::memset(body, 0x5a, sizeof body);
          for (std::uint64_t k = 0; k < per_pair; k += per_turn) {
            const std::uint64_t end = std::min(per_pair, k + per_turn);
            for (int j = t; j < n; j += threads) {
              const auto pair = static_cast<std::size_t>(j);
              std::optional<SendBatch> batch;
              if (batched) batch.emplace(to_[pair]);
              for (std::uint64_t i = k; i < end; ++i) {
                const std::uint64_t seq = sent_ + i;
                std::memcpy(body, &seq, sizeof seq);
                senders_[pair]->router().send(receivers_[pair]->id(), kPairsHandle, body, kEncRaw,
                                              std::chrono::seconds(60));
              }
            }
          }
        } catch (...) {
          std::lock_guard lk(error_mu);
          if (!error) error = std::current_exception();
        }
      });
    for (auto& t : ts) t.join();
    if (error) std::rethrow_exception(error);
    {
      std::unique_lock lk(mu_);
      if (!cv_.wait_until(lk, std::chrono::steady_clock::now() + std::chrono::seconds(120), [&] { return finished_; })) {
        // Say how far each short receiver got (read without its broker
        // thread's ordering: a report, not a check).
        std::string detail;
        for (std::size_t i = 0; i < inboxes_.size() && detail.size() < 2000; ++i) {
          const Inbox& b = *inboxes_[i];
          const std::uint64_t got = b.got;
          if (got < b.target.load())
            detail += fmt::format("; pair {} received {} of {}", i, got - sent_, per_pair);
        }
        throw std::runtime_error(kErrPairsLost + detail);
      }
    }
    sent_ += per_pair;
    for (auto& b : inboxes_)
      if (b->errors.load() != 0) throw std::runtime_error(kErrPairsBad);
    return std::chrono::duration<double>(done_at_ - t0).count();
  }

 private:
  void on_message(Inbox& box, const Message& m) {
    if (box.stall.load(std::memory_order_relaxed) && box.stall.exchange(false))
      std::this_thread::sleep_for(stall_);
    std::uint64_t seq = ~0ull;
    if (m.data.size() == kPairsMessageSize && m.header.src_id == box.from.load(std::memory_order_relaxed)) {
      std::uint8_t b[kPairsMessageSize];
      m.data.copy_to(b);
      std::memcpy(&seq, b, sizeof seq);
    }
    if (seq != box.next) box.errors.fetch_add(1);
    box.next = seq + 1;
    if (++box.got == box.target.load() && remaining_.fetch_sub(1) == 1) {
      std::lock_guard lk(mu_);
      done_at_ = std::chrono::steady_clock::now();
      finished_ = true;
      cv_.notify_all();
    }
  }

  // Declared before the connections, so they outlive every handler.
  std::vector<std::unique_ptr<Inbox>> inboxes_;
  std::uint64_t sent_ = 0;  // per pair, over all runs
  std::chrono::milliseconds stall_{0};  // set by run() before its first send
  std::atomic<int> remaining_{0};  // receivers not done with this run
  std::mutex mu_;
  std::condition_variable cv_;
  bool finished_ = false;      // under mu_
  std::chrono::steady_clock::time_point done_at_;  // under mu_: the last receipt
  std::vector<std::unique_ptr<Connection>> senders_, receivers_;
  std::vector<Context> to_;  // sender i's Context for receiver i (its batches)
};

}  // namespace spindle::bench
