// Options: what a context's router may hold and accept, set by the library
// user (RouterOptions) and, for spindle-router, from its command line.
//
// Every limit here bounds what a peer can make this process hold; see
// docs/PROTOCOL.md section 14 for the accounting rule.
//
// Thread safety: plain values.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include <spindle/frame.h>

namespace spindle {

inline constexpr std::size_t kDefaultHighWaterMark = 8u << 20;         // 8 MiB
inline constexpr std::size_t kDefaultPeerMemoryLimit = 64u << 20;      // 64 MiB
inline constexpr std::size_t kDefaultGlobalMemoryLimit = 1024u << 20;  // 1 GiB
inline constexpr std::size_t kDefaultOutboxSize = 1u << 20;            // 1 MiB
inline constexpr std::chrono::microseconds kDefaultWaitSpin{50};

struct RouterOptions {
  std::string name;  // this context's name, for logs
  std::uint32_t max_message_size = kDefaultMaxMessageSize;
  std::size_t high_water_mark = kDefaultHighWaterMark;
  std::chrono::milliseconds handshake_timeout{10000};
  bool unidirectional = false;  // children may not reach their siblings
  // fds (a memfd body counts as one) that one peer may have in flight through
  // this router, queued towards other peers; over it: dead reply (router/fds.cpp).
  std::size_t fd_quota = 1024;
  // fds this process may hold for all its peers at once (received, not yet
  // passed on or closed); past it, a listener's client's fds are not taken
  // and its frames that carry them are refused (stream/account.h, FdBudget).
  // 0: half of RLIMIT_NOFILE's soft limit when the router starts.
  std::size_t fd_limit = 0;
  // Payloads of at least this many bytes travel as a sealed memfd (stream/memfd.h).
  std::size_t memfd_threshold = 1u << 20;
  // What one peer, and all peers together, may make this router hold
  // (stream/account.h, docs/PROTOCOL.md §14).
  std::size_t peer_memory_limit = kDefaultPeerMemoryLimit;
  std::size_t memory_limit = kDefaultGlobalMemoryLimit;
  // A peer over its limit that does not read what is queued for it for this
  // long is disconnected (one over its limit only because this process holds
  // what it sent, such as a large result, is merely paused until released).
  std::chrono::milliseconds stall_timeout{10000};
  std::size_t outbox_size = kDefaultOutboxSize;
  // FORWARD_LOG from a listener's clients (always accepted from children).
  bool accept_client_logs = false;
  // Log lines a peer may cause per second (FORWARD_LOG, refusals), and burst.
  double peer_log_rate = 50;
  double peer_log_burst = 200;
  // A thread that waits for what this context's loop brings (a call's
  // answer, a job for a pool worker or serve(), a Select) and runs the loop
  // meanwhile polls it for up to this long before it sleeps. An answer
  // within the window costs neither side a wake-up, which on a VM is the
  // dearest part of a round trip; the price is up to this much CPU per wait,
  // and a thread whose polls keep finding nothing stops polling for a while.
  // A thread whose answers have been taking a little longer polls for a
  // quarter more than they take, up to four times this. 0 never polls.
  // (docs/GUIDE.md, section 6)
  std::chrono::microseconds wait_spin = kDefaultWaitSpin;
  // The broker's own thread polls the same way after each turn. It pays in
  // a process whose broker thread does the answering (a router; handlers
  // on the broker thread) with a CPU to spare, and costs throughput where
  // busy threads outnumber CPUs (many runtimes in one process), so it is
  // off here and on in spindle-router.
  bool own_thread_polls = false;
};

}  // namespace spindle
