// A slot's word holds its generation and state: (generation << 3) | state.
// Every transition is a compare-and-swap on the whole word, so a completer
// holding an old generation can never touch a slot that has since been
// reused, and of two completers racing for one call exactly one wins.
//
//   FREE --open--> PENDING --claim--> CLAIMED --> DONE (blocking: the waiter
//                     \                       \--> FREE (async: completion runs)
//                      \                       \--> RETIRED --> FREE (async,
//                       \                            completed off the broker
//                        \                           thread; the broker frees it)
//                         \--the waiter's deadline--> CANCELLED --> FREE
#include "router/call_table.h"

#include <algorithm>
#include <bit>

#include <boost/intrusive/set.hpp>
#include <fmt/format.h>

#include "broker/broker.h"
#include "broker/errors.h"
#include "broker/futex.h"
#include "broker/log.h"

namespace spindle {
namespace {

constexpr std::uint32_t kFree = 0, kPending = 1, kClaimed = 2, kDone = 3, kCancelled = 4,
                        kRetired = 5;
constexpr std::uint32_t kGenBits = 11;
constexpr std::uint32_t kIndexBits = 20;
// Slots retired off the broker thread between two reaps it is asked for.
constexpr std::uint32_t kRetiredPerReap = 256;

std::uint32_t state_of(std::uint32_t w) { return w & 7; }
std::uint32_t gen_of(std::uint32_t w) { return w >> 3; }
std::uint32_t index_of(std::uint32_t handle) { return handle & ((1u << kIndexBits) - 1); }
std::uint32_t handle_gen(std::uint32_t handle) { return (handle >> kIndexBits) & ((1u << kGenBits) - 1); }
std::uint32_t make_handle(std::uint32_t index, std::uint32_t gen) {
  return kCallHandleBit | ((gen & ((1u << kGenBits) - 1)) << kIndexBits) | index;
}
bool matches(std::uint32_t w, std::uint32_t handle) {
  return (gen_of(w) & ((1u << kGenBits) - 1)) == handle_gen(handle);
}

}  // namespace

struct CallTable::Slot : boost::intrusive::set_base_hook<> {
  std::atomic<std::uint32_t> word{0};
  std::uint32_t index = 0;
  // Read by other threads before they claim: atomic, and checked again by
  // the claim's compare-and-swap on the word.
  std::atomic<std::uint32_t> callee{0};
  std::atomic<bool> blocking{false};
  std::atomic<bool> anywhere{false};  // async, and its completion is thread-safe
  // Blocking: the waiter sleeps on `word` and is counted in the loop's
  // sleepers. Whoever turns it off (the completer, or the waiter that gives
  // up) settles that count.
  std::atomic<bool> sleeper{false};
  bool armed = false;  // broker thread
  Clock::time_point deadline;
  Message reply;
  std::exception_ptr error;
  Completion done;
};

struct CallTable::Deadlines {
  struct ByDeadline {
    bool operator()(const Slot& a, const Slot& b) const { return a.deadline < b.deadline; }
  };
  boost::intrusive::multiset<Slot, boost::intrusive::compare<ByDeadline>> set;
};

CallTable::CallTable(Broker* loop) : deadlines_(std::make_unique<Deadlines>()), loop_(loop) {
  static_assert(chunk_start(kChunks - 1) + kFirstChunk == kMaxSlots);
}

CallTable::~CallTable() {
  deadlines_->set.clear();
  for (auto& c : chunks_) delete[] c.load();
}

std::uint32_t CallTable::chunk_of(std::uint32_t index) {
  return static_cast<std::uint32_t>(std::bit_width(index / kFirstChunk + 1)) - 1;
}

CallTable::Slot& CallTable::at(std::uint32_t index) const {
  const std::uint32_t k = chunk_of(index);
  return chunks_[k].load(std::memory_order_acquire)[index - chunk_start(k)];
}

CallTable::Slot* CallTable::slot(std::uint32_t handle) const {
  std::uint32_t i = index_of(handle);
  if (i >= size_.load(std::memory_order_acquire)) return nullptr;
  return &at(i);
}

void CallTable::grow() {
  std::lock_guard lk(grow_mu_);
  std::uint32_t n = size_.load();
  if (n >= kMaxSlots)
    throw Error(fmt::format("too many calls pending at once (the limit is {})", kMaxSlots));
  const std::uint32_t k = chunk_of(n);  // n is where chunk k starts
  const std::uint32_t count = std::min(kFirstChunk << k, kMaxSlots - n);
  auto* chunk = new Slot[count];
  for (std::uint32_t i = 0; i < count; ++i) chunk[i].index = n + i;
  chunks_[k].store(chunk, std::memory_order_release);
  size_.store(n + count, std::memory_order_release);
  // Index 0 stays unused: handle 0x80000000 would look like "no reply_to" to
  // nobody, but an index of 0 is easy to mistake in a dump.
  for (std::uint32_t i = (n == 0 ? 1 : 0); i < count; ++i) free_.push(n + i);
}

std::uint32_t CallTable::open(std::uint32_t callee, bool blocking, Completion done, bool anywhere) {
  std::uint32_t index;
  while (!free_.pop(index)) grow();
  Slot& s = *slot(index);
  std::uint32_t gen = gen_of(s.word.load(std::memory_order_relaxed)) + 1;
  s.callee.store(callee, std::memory_order_relaxed);
  s.blocking.store(blocking, std::memory_order_relaxed);
  s.anywhere.store(anywhere, std::memory_order_relaxed);
  // `armed` is the broker's alone, and false on every free slot.
  s.done = std::move(done);
  s.word.store(gen << 3 | kPending, std::memory_order_release);
  pending_.fetch_add(1, std::memory_order_relaxed);
  return make_handle(index, gen);
}

std::uint32_t CallTable::open_blocking(std::uint32_t callee) { return open(callee, true, nullptr, false); }

std::uint32_t CallTable::open_async(std::uint32_t callee, Completion done, bool anywhere) {
  return open(callee, false, std::move(done), anywhere);
}

void CallTable::free_slot(Slot& s, std::uint32_t index) {
  pending_.fetch_sub(1, std::memory_order_relaxed);
  recycle(s, index);
}

// Broker thread for async slots (it alone unlinks a deadline).
void CallTable::recycle(Slot& s, std::uint32_t index) {
  if (s.armed) {
    deadlines_->set.erase(deadlines_->set.iterator_to(s));
    s.armed = false;
  }
  s.reply = Message{};
  s.error = nullptr;
  s.done.reset();
  std::uint32_t w = s.word.load(std::memory_order_relaxed);
  s.word.store((w & ~7u) | kFree, std::memory_order_release);
  free_.push(index);
}

void CallTable::abandon(std::uint32_t handle) {
  Slot* s = slot(handle);
  if (!s || !claim(*s, handle)) return;
  free_slot(*s, index_of(handle));
}

bool CallTable::claim(Slot& s, std::uint32_t handle) {
  std::uint32_t w = s.word.load(std::memory_order_acquire);
  if (state_of(w) != kPending || !matches(w, handle)) return false;
  return s.word.compare_exchange_strong(w, (w & ~7u) | kClaimed, std::memory_order_acq_rel);
}

void CallTable::finish(Slot& s, std::uint32_t index, Message&& m, std::exception_ptr e, bool on_broker) {
  if (s.blocking.load(std::memory_order_relaxed)) {
    s.reply = std::move(m);
    s.error = e;
    std::uint32_t w = s.word.load(std::memory_order_relaxed);
    s.word.store((w & ~7u) | kDone, std::memory_order_seq_cst);
    // Pairs with wait(): it turns `sleeper` on before it last looks at the
    // word, so either it sees DONE or this sees it asleep.
    if (s.sleeper.exchange(false, std::memory_order_seq_cst)) {
      futex::wake(s.word, 1);
      if (loop_) loop_->settle_sleeper();
    } else if (loop_ && !loop_->on_broker_thread()) {
      loop_->nudge_leading_caller();  // the waiter may be in epoll_wait, leading
    }
    return;
  }
  Completion done = std::move(s.done);
  if (on_broker) {
    free_slot(s, index);
  } else {
    // Its deadline may be armed (or about to be): only the broker may unlink
    // it. The slot waits, retired, for the broker's next reap.
    std::uint32_t w = s.word.load(std::memory_order_relaxed);
    s.word.store((w & ~7u) | kRetired, std::memory_order_release);
    pending_.fetch_sub(1, std::memory_order_relaxed);
    retired_.push(index);
    // The broker reaps when it next arms or expires a deadline; a call whose
    // deadline it never armed (answered before it could be) may give it no
    // reason to run: every kRetiredPerReap retirements ask it to.
    if ((retirements_.fetch_add(1, std::memory_order_relaxed) + 1) % kRetiredPerReap == 0 && loop_)
      loop_->try_post([this] { reap_retired(); });
  }
  try {
    if (done) done(std::move(m), e);
  } catch (const std::exception& ex) {
    log().error("a call's completion threw: {}", ex.what());
  } catch (...) {
    log().error("a call's completion threw a non-standard exception");
  }
}

void CallTable::reap_retired() {
  std::uint32_t index;
  while (retired_.pop(index)) recycle(at(index), index);  // counted out when retired
}

CallTable::Verdict CallTable::complete(std::uint32_t handle, Message&& m, bool on_broker) {
  Slot* s = slot(handle);
  if (!s) return Verdict::kStale;
  std::uint32_t w = s->word.load(std::memory_order_acquire);
  if (state_of(w) != kPending || !matches(w, handle)) return Verdict::kStale;
  if (m.header.src_id != s->callee.load(std::memory_order_relaxed)) return Verdict::kWrongSender;
  if (!claim(*s, handle)) return Verdict::kStale;
  std::exception_ptr e;
  if (m.is_dead()) {
    e = std::make_exception_ptr(ChannelError(m.text()));
  } else if (m.is_call_error()) {
    CallErrorText t = parse_call_error(m);
    e = std::make_exception_ptr(CallError(t.type, t.what));
  }
  if (e) m = Message{};
  finish(*s, index_of(handle), std::move(m), e, on_broker);
  return Verdict::kCompleted;
}

bool CallTable::fail(std::uint32_t handle, std::exception_ptr error) {
  Slot* s = slot(handle);
  if (!s || !claim(*s, handle)) return false;
  finish(*s, index_of(handle), Message{}, error);
  return true;
}

bool CallTable::completes_anywhere(std::uint32_t handle) const {
  Slot* s = slot(handle);
  return s && (s->blocking.load(std::memory_order_relaxed) || s->anywhere.load(std::memory_order_relaxed));
}

bool CallTable::is_pending(std::uint32_t handle) const {
  Slot* s = slot(handle);
  if (!s) return false;
  std::uint32_t w = s->word.load(std::memory_order_acquire);
  return state_of(w) == kPending && matches(w, handle);
}

std::optional<std::uint32_t> CallTable::callee_of(std::uint32_t handle) const {
  Slot* s = slot(handle);
  if (!s) return std::nullopt;
  std::uint32_t w = s->word.load(std::memory_order_acquire);
  if (state_of(w) != kPending || !matches(w, handle)) return std::nullopt;
  return s->callee.load(std::memory_order_relaxed);
}

bool CallTable::settled(const void* slot) {
  auto& s = *static_cast<const Slot*>(slot);
  return state_of(s.word.load(std::memory_order_seq_cst)) != kPending;
}

// Leads the loop while it is free (the reply then arrives on this thread);
// sleeps on the word while another thread leads. A sleeper counts in the
// loop's sleepers, so whoever leads keeps the loop for it, and it tries to
// lead once more after it is counted: a leader that left just before sees
// the count or leaves the loop free for it (broker.h).
Message CallTable::wait(std::uint32_t handle, Clock::time_point deadline,
                        const std::function<std::exception_ptr()>& on_timeout) {
  Slot& s = *slot(handle);
  auto stop_sleeping = [&] {
    if (s.sleeper.exchange(false, std::memory_order_seq_cst) && loop_) loop_->settle_sleeper();
  };
  bool may_lead = loop_ != nullptr;
  while (true) {
    std::uint32_t w = s.word.load(std::memory_order_seq_cst);
    if (state_of(w) == kDone) {
      stop_sleeping();
      Message reply = std::move(s.reply);
      std::exception_ptr e = s.error;
      free_slot(s, index_of(handle));
      if (e) std::rethrow_exception(e);
      return reply;
    }
    bool timed_out = false;
    if (state_of(w) == kPending && may_lead) {
      Broker::Lead how = loop_->lead_until(&CallTable::settled, &s, deadline);
      if (how == Broker::Lead::kDone) continue;
      timed_out = how == Broker::Lead::kTimedOut;
      may_lead = false;
    }
    if (!timed_out) {
      if (loop_ && !s.sleeper.load(std::memory_order_relaxed)) {
        loop_->add_sleeper();
        s.sleeper.store(true, std::memory_order_seq_cst);
        may_lead = true;
        continue;  // look at the word again, and at the loop
      }
      // CLAIMED: a completer is storing the outcome; wait for it, whatever
      // the deadline says.
      auto until = state_of(w) == kClaimed ? Clock::time_point::max() : deadline;
      if (futex::wait(s.word, w, until)) continue;
    }
    std::uint32_t expect = w;
    if (state_of(w) == kPending &&
        s.word.compare_exchange_strong(expect, (w & ~7u) | kCancelled, std::memory_order_acq_rel)) {
      stop_sleeping();
      free_slot(s, index_of(handle));
      std::rethrow_exception(on_timeout());
    }
  }
}

void CallTable::arm_deadline(std::uint32_t handle, Clock::time_point when) {
  reap_retired();
  Slot* s = slot(handle);
  if (!s || s->blocking.load(std::memory_order_relaxed)) return;
  // The call may be over, and its slot reopened by another thread, before an
  // arm deferred from that thread arrives: check the generation before
  // touching anything else of the slot.
  std::uint32_t w = s->word.load(std::memory_order_acquire);
  if (state_of(w) != kPending || !matches(w, handle) || s->armed) return;
  s->deadline = when;
  s->armed = true;
  deadlines_->set.insert(*s);
}

std::uint32_t CallTable::request_arm(std::uint32_t handle, Clock::time_point when) {
  arm_requests_.push(ArmRequest{handle, when.time_since_epoch().count()});
  return arm_requests_pushed_.fetch_add(1, std::memory_order_seq_cst) + 1;
}

std::optional<CallTable::Clock::time_point> CallTable::arm_requested() {
  // Both seq_cst: a relaxed look could miss a request whose thread saw the
  // timer still due, and then neither side would arm it.
  if (arm_requests_pushed_.load(std::memory_order_seq_cst) == 0 ||
      arm_requests_pushed_.exchange(0, std::memory_order_seq_cst) == 0)
    return std::nullopt;
  std::optional<Clock::time_point> earliest;
  ArmRequest r;
  while (arm_requests_.pop(r)) {
    const Clock::time_point when{Clock::duration(r.when)};
    arm_deadline(r.handle, when);
    if (!earliest || when < *earliest) earliest = when;
  }
  return earliest;
}

std::optional<CallTable::Clock::time_point> CallTable::next_deadline() const {
  if (deadlines_->set.empty()) return std::nullopt;
  return deadlines_->set.begin()->deadline;
}

void CallTable::expire(Clock::time_point now,
                       const std::function<std::exception_ptr(std::uint32_t)>& on_timeout) {
  reap_retired();
  while (!deadlines_->set.empty() && deadlines_->set.begin()->deadline <= now) {
    Slot& s = *deadlines_->set.begin();
    deadlines_->set.erase(deadlines_->set.begin());
    s.armed = false;
    std::uint32_t w = s.word.load(std::memory_order_acquire);
    std::uint32_t handle = make_handle(s.index, gen_of(w));
    if (claim(s, handle)) finish(s, s.index, Message{}, on_timeout(s.callee.load()));
  }
}

std::size_t CallTable::fail_where(const std::function<bool(std::uint32_t)>& gone,
                                  const std::function<std::exception_ptr(std::uint32_t)>& why) {
  if (pending() == 0) return 0;
  const std::uint32_t n = size_.load(std::memory_order_acquire);
  for (std::uint32_t i = 1; i < n; ++i) {
    Slot& s = at(i);
    std::uint32_t w = s.word.load(std::memory_order_acquire);
    const std::uint32_t callee = s.callee.load(std::memory_order_relaxed);
    if (state_of(w) != kPending || !gone(callee)) continue;
    std::uint32_t handle = make_handle(i, gen_of(w));
    if (claim(s, handle)) finish(s, i, Message{}, why(callee));
  }
  return n;
}

}  // namespace spindle
