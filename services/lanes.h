// LaneSet: the queue a pool's workers (or a Select's waiters) take work from.
//
// Role: holds messages in lanes (one per service or receiver), and hands
// them to waiting threads under two rules:
//  - Wake rule: a message wakes at most one thread, and only when a thread is
//    idle. It is handed straight to that thread (which then needs no lock to
//    get it), so exactly one futex wake is spent on it. A message that finds
//    no idle thread waits in its lane and costs no wake at all: a busy thread
//    takes it on its way back. Idle threads are kept newest-first, so under a
//    light load one warm thread does the work and the others stay asleep.
//  - Fairness rule: lanes with queued messages form a ring. A taker takes one
//    message from the lane at the head of the ring and puts the lane back at
//    the tail if it has more. So a message waits behind at most one message
//    of every other lane with work, however deep those lanes are.
//  - Bounds rule: a lane holds up to its bounds (LaneOptions); past them, a
//    sender still queued only while it holds less than its share of them:
//    the bounds divided among the uids with work queued there, then among
//    each uid's senders (as a router's memory budget is: stream/account.h).
//    Who the sender is and its uid, the pusher says (by default the
//    message's auth_id and this process's uid; a ServiceHost says the link
//    it came by: Router::share_key). So one peer that fills a shared lane (a router's
//    ping service) shuts the others out for no longer than it took to fill
//    it; they get their share, it gets refusals. A lane holds at most twice
//    its bounds, as a router holds about twice its global memory limit.
// A serialized lane leaves the ring while one of its messages runs, and
// re-enters it when the taker calls done(): its messages run one at a time in
// arrival order.
//
// Shutdown: begin_drain() refuses new messages; takers keep taking queued
// ones and get nothing once the ring is empty. close() also drops the queue
// (returned to the caller, who answers each sender).
//
// Fork: every LaneSet is registered with the fork guard (services/fork.cpp),
// which freezes it across fork() so no worker is inside a message then.
//
// Thread safety: every member is safe from any thread.
// Ownership: owns its lanes and queued messages; the waiting threads are the
// caller's (Pool or Select). Lane pointers live as long as the set.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "services/adaptive_mutex.h"
#include "services/futex.h"
#include "spindle/message.h"
#include "stream/account.h"

namespace spindle {
class Broker;
}

namespace spindle::services {

// What one lane may hold queued: past either bound a push is refused (the
// sender gets a dead reply saying so), so the work a peer queues for a
// service or a receiver is bounded however fast it sends. An empty lane
// takes one message of any size (bounded by the router's maximum message
// size), so a lane holds at most max(max_bytes, one message).
inline constexpr std::size_t kDefaultLaneMaxMessages = 65536;
inline constexpr std::size_t kDefaultLaneMaxBytes = 64u << 20;
// A message this small that waits behind others is copied out of the receive
// chunk it shares (LaneSet::push), as a router copies what it holds.
inline constexpr std::size_t kCopiedWhenQueued = 8 * 1024;

struct LaneOptions {
  std::string name;
  bool serialized = false;  // one message at a time, in arrival order
  std::size_t max_messages = kDefaultLaneMaxMessages;
  std::size_t max_bytes = kDefaultLaneMaxBytes;
};

class Lane {
 public:
  const std::string& name() const { return opts_.name; }
  bool serialized() const { return opts_.serialized; }
  std::size_t max_messages() const { return opts_.max_messages; }
  std::size_t max_bytes() const { return opts_.max_bytes; }
  void* owner = nullptr;  // the Pool's or Select's per-lane record

 private:
  friend class LaneSet;
  explicit Lane(LaneOptions o) : opts_(std::move(o)) {}
  LaneOptions opts_;
  // What one sender has queued here (the bounds rule). Few senders have work
  // queued at once: searched in place, and the vector keeps its capacity, so
  // steady traffic allocates nothing.
  struct SenderLoad {
    std::uint64_t id;
    std::uint32_t uid;
    std::size_t messages;
    std::size_t bytes;
  };
  // The senders of one uid with work queued here.
  struct UidLoad {
    std::uint32_t uid;
    std::size_t senders;
  };
  SenderLoad* load_of(std::uint64_t sender);
  bool within_share(const SenderLoad* load, std::size_t size) const;
  void add_load(std::uint64_t sender, std::uint32_t uid, std::size_t size);
  void remove_load(std::uint64_t sender, std::size_t size);

  struct Queued {
    Message msg;
    std::uint64_t sender;  // whom its load is charged to
  };
  std::deque<Queued> queue_;  // guarded by the set's mutex
  std::size_t queued_bytes_ = 0;  // payload bytes in queue_, likewise
  std::vector<SenderLoad> senders_;  // likewise
  // Likewise: the uids of senders_, counted as senders come and go, so that
  // a push past the bounds costs one pass over the uids, not a count of
  // distinct uids over every sender.
  std::vector<UidLoad> uids_;
  bool in_ring_ = false;
  bool running_ = false;       // serialized lanes: one of its messages runs
  bool retired_ = false;       // refuses new messages
};

struct LaneStats {
  std::uint64_t pushed = 0;     // messages accepted
  std::uint64_t handed = 0;     // given straight to an idle thread
  std::uint64_t wakeups = 0;    // futex wakes issued (one per handed message)
  std::uint64_t timeouts = 0;   // waits that ended at their deadline
  std::size_t queued = 0;       // messages waiting now
  std::size_t running = 0;      // messages taken and not yet done()
  std::size_t idle = 0;         // threads asleep in take()
  std::uint64_t refused_full = 0;  // pushes refused: the lane held its maximum
};

class LaneSet {
 public:
  using Clock = std::chrono::steady_clock;
  struct Taken {
    Lane* lane = nullptr;
    Message msg;
  };

  LaneSet();
  ~LaneSet();
  LaneSet(const LaneSet&) = delete;
  LaneSet& operator=(const LaneSet&) = delete;

  Lane& add_lane(LaneOptions opts);
  enum class Push { kQueued, kClosed, kFull };
  // Queues `m` on `lane`, handing it to an idle thread if the lane may run.
  // Leaves `m` untouched unless kQueued: kClosed once draining or closed,
  // kFull when the lane holds its maximum (LaneOptions). `sender` is whose
  // share it counts against (the bounds rule), and `uid` whose part of the
  // bounds that sender's share is taken from; the first form says the
  // message's auth_id and this process's uid.
  Push push(Lane& lane, Message& m) { return push(lane, m, m.header.auth_id, process_uid()); }
  Push push(Lane& lane, Message& m, std::uint64_t sender, std::uint32_t uid);
  // Waits for a message until `deadline`. Empty on timeout, or when draining
  // with nothing left, or closed. Every message taken must be done() after.
  // With a loop set, a taker runs that broker's loop while it waits and no
  // other thread runs it (broker.h, leader/follower): a message the loop
  // hands it then needs no wake-up.
  // `finished`: the lane of the message this thread took last and has run,
  // done() under the same lock as the take (a worker's loop: one lock per
  // message where done() then take() cost two).
  std::optional<Taken> take(Clock::time_point deadline, Lane* finished = nullptr);
  // The broker whose loop brings this set its messages (a pool's: it
  // outlives the pool's threads).
  void set_loop(Broker* loop) { loop_.store(loop, std::memory_order_seq_cst); }
  // A Select's: each receiver joins with its router's broker, and leaves
  // before that broker may go. Takers lead only while every receiver's
  // messages come through one broker; the last leave_loop() returns once no
  // taker runs the loop.
  void join_loop(Broker* loop);
  void leave_loop();
  void done(Lane& lane);
  // Refuses new messages; takers drain the queue, then get nothing.
  void begin_drain();
  // Refuses new messages and returns every queued one; takers get nothing.
  std::vector<Taken> close();
  // The lane takes no more messages; returns those it still held.
  std::vector<Message> retire(Lane& lane);
  bool accepting() const;
  LaneStats stats() const;

  // --- fork guard (services/fork.cpp) only ---
  // Stops handing out messages and waits (up to `deadline`) until none is
  // running except the calling thread's own; false if one still was.
  bool freeze_for_fork(Clock::time_point deadline);
  // Takes the mutex, held across fork(); thaw_* releases it.
  void hold_for_fork();
  void thaw_in_parent();
  // In the child: the threads are gone; the set is inert and never touched.
  void thaw_in_child();

 private:
  struct Waiter {
    // 0 waiting, 1 handed a message, 2 nothing more, 3 stop running the
    // loop and look again (leave_loop)
    WakeWord word;
    std::optional<Taken> slot;
    // It found the loop busy: whoever hands it a message on the loop's own
    // thread asks that thread to step aside, so its next wait leads.
    std::atomic<bool> would_lead{false};
  };
  static constexpr std::uint32_t kLookAgain = 3;
  using WakeList = std::vector<std::pair<Waiter*, std::uint32_t>>;
  // Under mu_: takes the next message the fairness rule allows.
  std::optional<Taken> next_locked();
  // Under mu_: done() for `lane`, listing whom to wake.
  void done_locked(Lane& lane, WakeList& wake);
  // Under mu_: hands ready messages to idle threads, listing whom to wake.
  void hand_out_locked(WakeList& wake);
  void release_idle_locked(WakeList& wake);  // "nothing more" to every idle thread
  void wake_all(const WakeList& wake) const;
  void enter_ring_locked(Lane& lane);
  // Makes every taker that runs `loop` let go of it; returns once none does.
  void stop_leading(Broker* loop);

  mutable AdaptiveMutex mu_;
  std::condition_variable_any quiet_cv_;  // freeze_for_fork waits for running_ == self
  std::vector<std::unique_ptr<Lane>> lanes_;
  std::deque<Lane*> ring_;
  std::vector<Waiter*> idle_;  // newest last
  bool draining_ = false;
  bool closed_ = false;
  bool frozen_ = false;
  LaneStats stats_;
  std::atomic<Broker*> loop_{nullptr};
  std::atomic<int> loop_users_{0};  // takers between loading loop_ and leaving its lead
  // A Select's receivers (join_loop), under mu_: the first one's broker,
  // and how many joined. With receivers on more than one broker, loop_ is
  // empty and nobody leads.
  Broker* joined_ = nullptr;
  int joined_count_ = 0;
};

}  // namespace spindle::services
