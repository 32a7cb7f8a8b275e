// One mutex guards the lanes, the ring and the list of idle threads; it is
// held only to move pointers, never across a wake or a handler. An idle
// thread parks on a WakeWord of its own (on its stack) and is handed its
// message before it is woken, so the woken thread takes no lock to get it and
// nobody else can steal it: one message, one wake, one running thread. An
// idle thread that cannot lead the loop first looks at its word for its
// broker's wait_spin (WakeWord::wait's poll window): a message handed within
// that window costs no futex call on either side. With one caller calling
// back to back, its worker slept after every message before (bench_services,
// pool_calls_1_caller: 0.45 sleeps per message, 29.8 k calls/s; after: 0.001
// sleeps, 52 k calls/s).
//
// Why per-thread words rather than a shared semaphore or condition variable:
// bench/services.cpp measures the three on the same hand-off. All three wake
// one thread per message at best, but with a shared counter the thread woken
// must still lock the queue to find its message (and may find it taken by a
// thread that was not asleep), so it pays a second lock and, under load,
// spurious wake-ups; handing off directly pays neither.
#include "services/lanes.h"

#include <algorithm>
#include <thread>

#include "broker/broker.h"
#include "services/fork.h"

namespace spindle::services {
namespace {
// The set whose message this thread is running (between take and done), so a
// fork from inside a handler does not wait for its own thread.
thread_local const LaneSet* tl_running_in = nullptr;
// The set this thread is a taker of while it may run the loop (take()), so
// that stop_leading() run by a handler on that very thread does not wait
// for itself.
thread_local const LaneSet* tl_may_lead_for = nullptr;
}  // namespace

LaneSet::LaneSet() { fork_guard::register_set(this); }

LaneSet::~LaneSet() {
  fork_guard::unregister_set(this);
  WakeList idle;
  {
    std::lock_guard lk(mu_);
    closed_ = true;
    release_idle_locked(idle);
  }
  wake_all(idle);
}

Lane& LaneSet::add_lane(LaneOptions opts) {
  std::lock_guard lk(mu_);
  lanes_.push_back(std::unique_ptr<Lane>(new Lane(std::move(opts))));
  return *lanes_.back();
}

Lane::SenderLoad* Lane::load_of(std::uint64_t sender) {
  for (SenderLoad& l : senders_)
    if (l.id == sender) return &l;
  return nullptr;
}

// A sender holding nothing may always queue one message, as an empty lane
// takes one of any size; otherwise what it would hold must stay within its
// share of both bounds.
bool Lane::within_share(const SenderLoad* load, std::size_t size) const {
  if (!load) return true;
  // The bounds divided among the uids with work here, then among the
  // senders of this one's uid.
  std::size_t mine = 1;
  for (const UidLoad& u : uids_)
    if (u.uid == load->uid) mine = u.senders;
  const std::size_t n = uids_.size() * mine;
  return load->messages < opts_.max_messages / n && load->bytes + size <= opts_.max_bytes / n;
}

void Lane::add_load(std::uint64_t sender, std::uint32_t uid, std::size_t size) {
  SenderLoad* l = load_of(sender);
  if (!l) {
    l = &senders_.emplace_back(SenderLoad{sender, uid, 0, 0});
    auto u = std::find_if(uids_.begin(), uids_.end(), [uid](const UidLoad& x) { return x.uid == uid; });
    if (u == uids_.end()) uids_.push_back(UidLoad{uid, 1});
    else ++u->senders;
  }
  ++l->messages;
  l->bytes += size;
}

void Lane::remove_load(std::uint64_t sender, std::size_t size) {
  SenderLoad* l = load_of(sender);
  if (!l) return;
  l->bytes -= std::min(l->bytes, size);
  if (--l->messages > 0) return;
  const std::uint32_t uid = l->uid;
  *l = senders_.back();
  senders_.pop_back();
  auto u = std::find_if(uids_.begin(), uids_.end(), [uid](const UidLoad& x) { return x.uid == uid; });
  if (u != uids_.end() && --u->senders == 0) {
    *u = uids_.back();
    uids_.pop_back();
  }
}

void LaneSet::enter_ring_locked(Lane& lane) {
  if (lane.in_ring_ || lane.queue_.empty() || (lane.serialized() && lane.running_)) return;
  lane.in_ring_ = true;
  ring_.push_back(&lane);
}

std::optional<LaneSet::Taken> LaneSet::next_locked() {
  if (ring_.empty() || frozen_ || closed_) return std::nullopt;
  Lane* lane = ring_.front();
  ring_.pop_front();
  lane->in_ring_ = false;
  const std::uint64_t sender = lane->queue_.front().sender;
  Taken t{lane, std::move(lane->queue_.front().msg)};
  lane->queue_.pop_front();
  lane->queued_bytes_ -= std::min(lane->queued_bytes_, t.msg.data.size());
  lane->remove_load(sender, t.msg.data.size());
  if (lane->serialized()) lane->running_ = true;
  enter_ring_locked(*lane);  // back at the tail, if it has more and may run
  ++stats_.running;
  --stats_.queued;
  return t;
}

void LaneSet::release_idle_locked(WakeList& wake) {
  for (Waiter* w : idle_) wake.push_back({w, 2});
  idle_.clear();
}

// Outside the lock: a waiter reads its slot only after seeing its word set.
void LaneSet::wake_all(const WakeList& wake) const {
  for (auto [w, value] : wake) w->word.set_and_wake(value);
  // A waiter may be running the loop, asleep in epoll_wait, not on its word.
  Broker* loop = loop_.load(std::memory_order_acquire);
  if (loop && !wake.empty() && !loop->on_broker_thread()) loop->nudge_leading_caller();
}

void LaneSet::hand_out_locked(WakeList& wake) {
  while (!idle_.empty()) {
    auto t = next_locked();
    if (!t) return;
    Waiter* w = idle_.back();
    idle_.pop_back();
    if (w->would_lead.load(std::memory_order_relaxed))
      if (Broker* loop = loop_.load(std::memory_order_acquire)) loop->step_aside_soon();
    w->slot = std::move(t);
    ++stats_.handed;
    ++stats_.wakeups;
    wake.push_back({w, 1});
  }
}

LaneSet::Push LaneSet::push(Lane& lane, Message& m, std::uint64_t sender, std::uint32_t uid) {
  WakeList wake;
  {
    std::lock_guard lk(mu_);
    if (draining_ || closed_ || lane.retired_) return Push::kClosed;
    const std::size_t size = m.data.size();
    // The byte bound admits one message of any size into an empty lane: the
    // message is already received (and charged to its sender by the router),
    // so refusing it frees nothing, while a bound below the largest message
    // would refuse every large call (a 256 MiB array) however idle the lane.
    const bool backlog = !lane.queue_.empty();
    const bool over_bytes = backlog && lane.queued_bytes_ + size > lane.opts_.max_bytes;
    const bool over = lane.queue_.size() >= lane.opts_.max_messages || over_bytes;
    // Past twice the bounds nobody is queued: a sender holding nothing
    // passes its share, and a peer that reconnects is a new sender each time.
    const bool past_twice = lane.queue_.size() >= 2 * lane.opts_.max_messages ||
                            (backlog && lane.queued_bytes_ + size > 2 * lane.opts_.max_bytes);
    if (past_twice || (over && !lane.within_share(lane.load_of(sender), size))) {
      ++stats_.refused_full;
      return Push::kFull;
    }
    // A small message that will wait keeps its own bytes, not the 128 KiB
    // receive chunk it arrived in (charged to its peer, but a peer that
    // reconnects leaves one behind per connection). Only behind a backlog:
    // a message taken at once is not copied.
    if (backlog && size <= kCopiedWhenQueued) m.data = m.data.owned_copy();
    lane.queued_bytes_ += size;
    lane.add_load(sender, uid, size);
    lane.queue_.push_back(Lane::Queued{std::move(m), sender});
    ++stats_.pushed;
    ++stats_.queued;
    enter_ring_locked(lane);
    hand_out_locked(wake);
  }
  wake_all(wake);
  return Push::kQueued;
}

std::optional<LaneSet::Taken> LaneSet::take(Clock::time_point deadline, Lane* finished) {
  Waiter self;
  {
    WakeList wake;
    std::unique_lock lk(mu_);
    if (finished) done_locked(*finished, wake);
    std::optional<Taken> t = next_locked();
    // Draining with an empty ring: what is left belongs to serialized lanes
    // now running, and the thread running each takes its tail itself.
    const bool none = !t && (closed_ || (draining_ && ring_.empty()));
    if (t) tl_running_in = this;
    else if (!none) idle_.push_back(&self);
    lk.unlock();
    wake_all(wake);
    if (t || none) return t;
  }
  for (;;) {
    std::uint32_t v = self.word.load();
    if (v == 1) {
      tl_running_in = this;
      return std::move(self.slot);
    }
    if (v == 2) return std::nullopt;
    if (v == kLookAgain) {  // leave_loop: the loop we ran may be going
      self.word.clear_if(kLookAgain);
      continue;
    }
    bool timed_out = false;
    // Counted while it may touch the loop, so that leave_loop() knows when
    // nobody does any more.
    loop_users_.fetch_add(1, std::memory_order_seq_cst);
    tl_may_lead_for = this;
    Broker* loop = loop_.load(std::memory_order_seq_cst);
    Broker::Lead how = loop ? loop->lead_until(&WakeWord::is_set, &self.word, deadline) : Broker::Lead::kBusy;
    tl_may_lead_for = nullptr;
    loop_users_.fetch_sub(1, std::memory_order_seq_cst);
    if (loop) {
      if (how == Broker::Lead::kDone) continue;
      if (how == Broker::Lead::kBusy) self.would_lead.store(true, std::memory_order_relaxed);
      timed_out = how == Broker::Lead::kTimedOut;
    }
    if (timed_out || !self.word.wait(0, deadline, loop ? loop->wait_spin() : kDefaultWaitSpin)) {
      std::lock_guard lk(mu_);
      auto it = std::find(idle_.begin(), idle_.end(), &self);
      if (it == idle_.end()) {
        // Someone took us off the idle list and is about to set our word
        // (a message, or "nothing more"): wait for it, past the deadline.
        deadline = Clock::time_point::max();
        continue;
      }
      idle_.erase(it);
      ++stats_.timeouts;
      return std::nullopt;
    }
  }
}

void LaneSet::join_loop(Broker* loop) {
  Broker* stop = nullptr;
  {
    std::lock_guard lk(mu_);
    if (joined_count_++ == 0) {
      joined_ = loop;
      loop_.store(loop, std::memory_order_seq_cst);
      return;
    }
    // Messages now come through two loops: a taker running one would not
    // see the other's. Nobody leads (loop_ stays empty: "mixed") until
    // every receiver has left.
    if (joined_ == loop) return;
    stop = loop_.exchange(nullptr, std::memory_order_seq_cst);
  }
  if (stop) stop_leading(stop);
}

void LaneSet::leave_loop() {
  Broker* stop = nullptr;
  {
    std::lock_guard lk(mu_);
    if (joined_count_ == 0 || --joined_count_ > 0) return;
    joined_ = nullptr;
    stop = loop_.exchange(nullptr, std::memory_order_seq_cst);
  }
  if (stop) stop_leading(stop);
}

// loop_ no longer names `loop`: a taker loading it from now on does not lead.
// Those that may still run `loop` are told to look again (their lead ends:
// its predicate sees the word set) and pulled out of epoll_wait. Run by a
// handler on a taker that leads (a receiver destroyed by a deferred function,
// as the Python binding's Select moves do), it does not wait for that taker:
// its lead ends when the handler returns, and the broker cannot be destroyed
// before that.
void LaneSet::stop_leading(Broker* loop) {
  {
    std::lock_guard lk(mu_);
    for (Waiter* w : idle_) w->word.set_and_wake(kLookAgain);
  }
  const int self = tl_may_lead_for == this ? 1 : 0;
  while (loop_users_.load(std::memory_order_seq_cst) > self) {
    loop->nudge_leading_caller();
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void LaneSet::done(Lane& lane) {
  WakeList wake;
  {
    std::lock_guard lk(mu_);
    done_locked(lane, wake);
  }
  wake_all(wake);
}

void LaneSet::done_locked(Lane& lane, WakeList& wake) {
  tl_running_in = nullptr;
  --stats_.running;
  if (lane.serialized()) {
    lane.running_ = false;
    enter_ring_locked(lane);
    hand_out_locked(wake);
  }
  if (frozen_) quiet_cv_.notify_all();  // freeze_for_fork is the only waiter
  // Draining and nothing left for anyone: let the idle threads go.
  if (draining_ && ring_.empty()) release_idle_locked(wake);
}

void LaneSet::begin_drain() {
  WakeList wake;
  {
    std::lock_guard lk(mu_);
    if (draining_) return;
    draining_ = true;
    // Idle threads exist only when nothing runnable is queued; messages of a
    // running serialized lane are taken by the thread that finishes it.
    if (ring_.empty()) release_idle_locked(wake);
  }
  wake_all(wake);
}

std::vector<Message> LaneSet::retire(Lane& lane) {
  std::lock_guard lk(mu_);
  lane.retired_ = true;
  if (lane.in_ring_) ring_.erase(std::find(ring_.begin(), ring_.end(), &lane));
  lane.in_ring_ = false;
  std::vector<Message> left;
  left.reserve(lane.queue_.size());
  for (Lane::Queued& q : lane.queue_) left.push_back(std::move(q.msg));
  stats_.queued -= left.size();
  lane.queue_.clear();
  lane.queued_bytes_ = 0;
  lane.senders_.clear();
  lane.uids_.clear();
  return left;
}

std::vector<LaneSet::Taken> LaneSet::close() {
  std::vector<Taken> left;
  WakeList wake;
  {
    std::lock_guard lk(mu_);
    draining_ = closed_ = true;
    for (auto& l : lanes_) {
      for (Lane::Queued& q : l->queue_) left.push_back(Taken{l.get(), std::move(q.msg)});
      l->queue_.clear();
      l->queued_bytes_ = 0;
      l->senders_.clear();
      l->uids_.clear();
      l->in_ring_ = false;
    }
    ring_.clear();
    stats_.queued = 0;
    release_idle_locked(wake);
  }
  wake_all(wake);
  return left;
}

bool LaneSet::accepting() const {
  std::lock_guard lk(mu_);
  return !draining_ && !closed_;
}

LaneStats LaneSet::stats() const {
  std::lock_guard lk(mu_);
  LaneStats s = stats_;
  s.idle = idle_.size();
  return s;
}

bool LaneSet::freeze_for_fork(Clock::time_point deadline) {
  std::unique_lock lk(mu_);
  frozen_ = true;
  const std::size_t own = tl_running_in == this ? 1 : 0;
  return quiet_cv_.wait_until(lk, deadline, [&] { return stats_.running <= own; });
}

void LaneSet::hold_for_fork() { mu_.lock(); }  // thaw_* unlocks

void LaneSet::thaw_in_parent() {
  WakeList wake;
  frozen_ = false;
  hand_out_locked(wake);
  mu_.unlock();
  wake_all(wake);
}

void LaneSet::thaw_in_child() {
  // The parent's threads do not exist here; nothing may wait for them.
  closed_ = true;
  idle_.clear();
  mu_.unlock();
}

}  // namespace spindle::services
