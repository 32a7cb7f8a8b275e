// The load scenario, shared by tests/test_load.cpp and bench/load.cpp: N
// clients of one spindle-router, each sending M messages to peers picked at
// random, from a few sender threads. Every message carries its sender, its
// sequence number on that (sender, receiver) pair and a checksum, so each
// receiver can check that nothing was lost, corrupted or reordered per pair.
//
// Senders use Router::send(), which waits while the router link's queue is
// over its high-water mark: nothing is dropped for back-pressure, and a
// failure to send is counted as an error, never retried silently.
//
// Thread safety: run() on one thread; it starts the clients and senders.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <fmt/format.h>

#include "broker/log.h"
#include "router/connect.h"
#include "stream/byte_order.h"

namespace spindle::load {

struct Options {
  std::string socket;
  int clients = 32;
  int messages = 2000;     // per client
  std::size_t size = 64;   // payload bytes (at least 16)
  int sender_threads = 4;
  std::chrono::seconds guard{240};  // hang guard for the whole run
};

struct Result {
  std::uint64_t sent = 0, received = 0;
  std::uint64_t out_of_order = 0, corrupt = 0, send_errors = 0;
  std::vector<std::string> errors;  // the first few, for the report
  double seconds = 0;               // first send to last receipt
  bool timed_out = false;
};

inline constexpr std::uint32_t kLoadHandle = 2300;

namespace detail {

// Payload: sender u32 | pair sequence u32 | checksum u32 | filler.
inline std::uint32_t checksum(std::uint32_t from, std::uint32_t seq) {
  return (from * 2654435761u) ^ (seq * 40503u) ^ 0x5a5a5a5au;
}

// What one client has received: per sender, the next sequence expected.
struct Inbox {
  std::mutex mu;
  std::unordered_map<std::uint32_t, std::uint32_t> next_seq;
};

}  // namespace detail

inline Result run(const Options& o) {
  using Clock = std::chrono::steady_clock;
  Result res;
  std::atomic<std::uint64_t> received{0}, out_of_order{0}, corrupt{0}, send_errors{0};
  std::mutex err_mu;
  auto note = [&](std::string e) {
    std::lock_guard lk(err_mu);
    if (res.errors.size() < 10) res.errors.push_back(std::move(e));
  };

  std::vector<std::unique_ptr<detail::Inbox>> inboxes;
  std::vector<std::unique_ptr<Connection>> clients;
  for (int i = 0; i < o.clients; ++i) {
    inboxes.push_back(std::make_unique<detail::Inbox>());
    RouterOptions ro;
    ro.name = fmt::format("load-{}", i);
    auto c = std::make_unique<Connection>(ro);
    detail::Inbox& box = *inboxes.back();
    c->router().add_handler(
        [&](Message&& m) {
          if (m.data.size() < 12) {
            ++corrupt;
            return;
          }
          const std::string text = m.text();  // small: a copy is simplest
          auto* bytes = reinterpret_cast<const std::uint8_t*>(text.data());
          std::uint32_t from = be::get32(bytes), seq = be::get32(bytes + 4);
          if (be::get32(bytes + 8) != detail::checksum(from, seq) || from != m.header.src_id) {
            ++corrupt;
            note(fmt::format("corrupt message from {} seq {}", m.header.src_id, seq));
          } else {
            std::lock_guard lk(box.mu);
            std::uint32_t& want = box.next_seq[from];
            if (seq != want) {
              ++out_of_order;
              note(fmt::format("from {}: seq {} arrived, {} expected", from, seq, want));
            }
            want = seq + 1;
          }
          received.fetch_add(1, std::memory_order_release);
        },
        {}, kLoadHandle);
    c->connect(UnixAddress::parse(o.socket));
    clients.push_back(std::move(c));
  }
  std::vector<std::uint32_t> ids;
  for (auto& c : clients) ids.push_back(c->id());

  const std::uint64_t total = static_cast<std::uint64_t>(o.clients) * o.messages;
  auto start = Clock::now();
  std::vector<std::thread> senders;
  for (int t = 0; t < o.sender_threads; ++t) {
    senders.emplace_back([&, t] {
      std::mt19937 rng(1000 + t);
      // Each thread owns the clients i with i % threads == t; per (sender,
      // receiver) pair the sequence lives here, so it is single-threaded.
      std::vector<int> mine;
      for (int i = t; i < o.clients; i += o.sender_threads) mine.push_back(i);
      std::vector<std::unordered_map<std::uint32_t, std::uint32_t>> seqs(mine.size());
      std::string body(std::max<std::size_t>(o.size, 12), 'x');
      for (int k = 0; k < o.messages; ++k) {
        for (std::size_t j = 0; j < mine.size(); ++j) {
          Connection& c = *clients[mine[j]];
          std::uint32_t to = ids[rng() % ids.size()];
          std::uint32_t seq = seqs[j][to]++;
          auto* p = reinterpret_cast<std::uint8_t*>(body.data());
          be::put32(p, c.id());
          be::put32(p + 4, seq);
          be::put32(p + 8, detail::checksum(c.id(), seq));
          try {
            c.router().send(Message::make(to, kLoadHandle, Payload::copy_of(body)),
                            std::chrono::seconds(60));
          } catch (const std::exception& e) {
            ++send_errors;
            note(fmt::format("send from {} to {}: {}", c.id(), to, e.what()));
          }
        }
      }
    });
  }
  for (auto& s : senders) s.join();
  auto until = Clock::now() + o.guard;
  while (received.load(std::memory_order_acquire) + send_errors.load() < total) {
    if (Clock::now() > until) {
      res.timed_out = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  res.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  res.sent = total - send_errors.load();
  res.received = received.load();
  res.out_of_order = out_of_order.load();
  res.corrupt = corrupt.load();
  res.send_errors = send_errors.load();
  for (auto& c : clients) c->close();
  return res;
}

}  // namespace spindle::load
