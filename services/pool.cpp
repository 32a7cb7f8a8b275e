// Workers loop on LaneSet::take() with no deadline: an idle worker sleeps on
// its own futex word until a message is handed to it or the pool drains.
// Stopping is a state, not a thread: stop() marks the pool stopping and
// drains the set; each worker, before running a message, checks the stop
// deadline and answers the message with a dead reply instead once it has
// passed; the last worker to leave its loop runs the on_stopped callbacks and
// tells an attached broker that the pool has drained. So stop() from inside a
// handler needs no other thread, and a broker shutdown never blocks its
// thread on a join.
#include "services/pool.h"

#include <thread>

#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <fmt/format.h>
#include <future>

#include "broker/errors.h"
#include "broker/log.h"
#include "services/reply.h"

namespace spindle::services {
namespace {
thread_local const Pool* tl_pool = nullptr;
}  // namespace

Pool::Pool(PoolOptions opts) : opts_(std::move(opts)) {
  if (opts_.threads == 0 || opts_.threads > kMaxThreads)
    throw Error(fmt::format("pool {}: {} threads requested; a pool has 1 to {}", opts_.name,
                            opts_.threads, kMaxThreads));
  if (opts_.caller_thread && opts_.threads != 1)
    throw Error(fmt::format("pool {}: a caller_thread pool has exactly 1 worker, not {}", opts_.name,
                            opts_.threads));
  live_ = opts_.threads;
  tids_.assign(opts_.threads, 0);
  if (opts_.caller_thread) return;
  threads_.reserve(opts_.threads);
  for (std::size_t i = 0; i < opts_.threads; ++i) {
    try {
      threads_.emplace_back([this, i] { work(i); });
    } catch (...) {
      {
        std::lock_guard lk(mu_);
        live_ -= opts_.threads - i;  // these never started
      }
      stop();
      throw;
    }
  }
  // Return only once every worker sleeps in take(): a worker still starting
  // up (naming itself, allocating) may hold the allocator's lock, and a
  // fork() at that moment would hand the child that lock held forever (seen
  // under ASan: a child forked right after a pool was made never finished
  // its handshake). Asleep on its futex word, a worker holds nothing.
  while (lanes_.stats().idle < opts_.threads)
    std::this_thread::sleep_for(std::chrono::microseconds(50));
}

Pool::~Pool() {
  stop();
  detach_broker();
  for (auto& [router, handle] : handles_) del_handler_on_broker(*router, handle);
}

Lane& Pool::add_lane(LaneOptions opts, Job run, Reject reject) {
  Lane& lane = lanes_.add_lane(std::move(opts));
  std::lock_guard lk(jobs_mu_);
  jobs_.push_back(std::make_unique<LaneJob>(LaneJob{std::move(run), std::move(reject)}));
  lane.owner = jobs_.back().get();
  return lane;
}

void Pool::submit(Lane& lane, Message&& m, std::uint64_t sender, std::uint32_t uid) {
  switch (lanes_.push(lane, m, sender, uid)) {
    case LaneSet::Push::kQueued: return;
    case LaneSet::Push::kClosed:
      return static_cast<LaneJob*>(lane.owner)->reject(std::move(m), reason::kShuttingDown);
    case LaneSet::Push::kFull: {
      std::string why = fmt::format(
          "{}: lane {} holds {} messages at most and {} bytes, and context {} holds its share of "
          "them (pool {})",
          reason::kQueueFull, lane.name(), lane.max_messages(), lane.max_bytes(), m.header.auth_id,
          opts_.name);
      return static_cast<LaneJob*>(lane.owner)->reject(std::move(m), why);
    }
  }
}

std::uint32_t Pool::add_handler(Router& router, HandlerFn fn, LaneOptions lane_opts,
                                HandlerOptions opts, std::uint32_t handle) {
  Lane& lane = add_lane(
      std::move(lane_opts), std::move(fn),
      [&router](Message&& m, std::string_view why) { send_dead_reply(router, m, why); });
  lanes_.set_loop(&router.broker());
  std::uint32_t h = router.add_handler(
      [this, &lane, &router](Message&& m) {
        const Router::ShareKey key = router.share_key(m.header.auth_id);
        submit(lane, std::move(m), key.sender, key.uid);
      },
                                       std::move(opts), handle);
  if (h == 0) throw Error(fmt::format("pool {}: handle {} is already taken", opts_.name, handle));
  std::lock_guard lk(mu_);
  handles_.emplace_back(&router, h);
  return h;
}

void Pool::work(std::size_t index) {
  const Pool* outer = tl_pool;
  tl_pool = this;
  {
    std::lock_guard lk(mu_);
    tids_[index] = static_cast<pid_t>(::syscall(SYS_gettid));
  }
  if (!opts_.caller_thread) {  // a lent thread keeps its owner's name
    std::string tname = fmt::format("{}-{}", opts_.name, index).substr(0, 15);
    pthread_setname_np(pthread_self(), tname.c_str());  // cosmetic: failure is harmless
  }
  // Each message's done() goes with the next take: one lock per message.
  Lane* finished = nullptr;
  while (auto t = lanes_.take(LaneSet::Clock::time_point::max(), finished)) {
    run_one(*t);
    finished = t->lane;
  }
  tl_pool = outer;
  worker_exited();
}

void Pool::serve_here() {
  {
    std::lock_guard lk(mu_);
    if (!opts_.caller_thread)
      throw Error(fmt::format("pool {}: serve_here() needs a caller_thread pool", opts_.name));
    if (served_) throw Error(fmt::format("pool {}: serve_here() was already called", opts_.name));
    served_ = true;
  }
  work(0);
}

void Pool::run_one(LaneSet::Taken& t) {
  auto* job = static_cast<LaneJob*>(t.lane->owner);
  // One relaxed load per message while running; the clock is read only
  // once the pool is stopping.
  bool late = late_.load(std::memory_order_relaxed);
  if (!late && stopping()) {
    std::lock_guard lk(mu_);
    late = std::chrono::steady_clock::now() > stop_deadline_;
    if (late) late_.store(true, std::memory_order_relaxed);
  }
  try {
    if (late) job->reject(std::move(t.msg), reason::kStopDeadline);
    else job->run(std::move(t.msg));
  } catch (const std::exception& e) {
    log().error("pool {}: lane {}: a job threw: {:?}", opts_.name, t.lane->name(),
                std::string_view(e.what()));
  } catch (...) {
    log().error("pool {}: lane {}: a job threw a non-std exception", opts_.name, t.lane->name());
  }
}

void Pool::worker_exited() {
  std::vector<std::function<void()>> fns;
  bool tell_broker = false;
  {
    std::lock_guard lk(mu_);
    if (--live_ != 0) return;
    fns.swap(stopped_fns_);
  }
  // The last worker out: no handler is running any more.
  for (auto& fn : fns) {
    try {
      fn();
    } catch (const std::exception& e) {
      log().error("pool {}: on_stopped callback threw: {}", opts_.name, e.what());
    } catch (...) {
      log().error("pool {}: on_stopped callback threw a non-std exception", opts_.name);
    }
  }
  {
    std::lock_guard lk(mu_);
    tell_broker = broker_told_ && !drained_reported_;
    drained_reported_ = drained_reported_ || tell_broker;
    all_exited_cv_.notify_all();
  }
  if (tell_broker) broker_->try_defer([this] { broker_->participant_drained(this); });
}

void Pool::begin_stop() {
  {
    std::lock_guard lk(mu_);
    if (stopping_) return;
    stopping_ = true;
    stopping_flag_.store(true, std::memory_order_release);
    stop_deadline_ = std::chrono::steady_clock::now() + opts_.stop_deadline;
  }
  lanes_.begin_drain();
}

void Pool::stop() {
  begin_stop();
  if (on_worker_thread()) return;  // a worker cannot join itself
  bool drain_here = false;
  {
    std::lock_guard lk(mu_);
    if (opts_.caller_thread && !served_) drain_here = served_ = true;
  }
  // Nobody served: what was accepted still runs (or gets its dead reply
  // past the deadline), here, rather than being lost.
  if (drain_here) work(0);
  join_workers();
}

void Pool::join_workers() {
  std::lock_guard join_lk(join_mu_);
  {
    std::unique_lock lk(mu_);
    if (joined_) return;
    if (!all_exited_cv_.wait_until(lk, stop_deadline_ + std::chrono::milliseconds(100),
                                   [&] { return live_ == 0; })) {
      log().warn("pool {}: {} worker(s) still inside a handler after the stop deadline; waiting",
                 opts_.name, live_);
      all_exited_cv_.wait(lk, [&] { return live_ == 0; });
    }
  }
  for (auto& t : threads_)
    if (t.joinable()) t.join();
  std::lock_guard lk(mu_);
  joined_ = true;
}

bool Pool::stopping() const { return stopping_flag_.load(std::memory_order_acquire); }

Broker* Pool::attached_broker() const {
  std::lock_guard lk(mu_);
  return broker_;
}

void Pool::on_stopped(std::function<void()> fn) {
  {
    std::lock_guard lk(mu_);
    if (live_ != 0) {
      stopped_fns_.push_back(std::move(fn));
      return;
    }
  }
  fn();  // already stopped
}

std::vector<pid_t> Pool::worker_tids() const {
  std::lock_guard lk(mu_);
  return tids_;
}

bool Pool::on_worker_thread() const { return tl_pool == this; }

void Pool::attach(Broker& broker) {
  {
    std::lock_guard lk(mu_);
    if (broker_) throw Error(fmt::format("pool {} is already attached to a broker", opts_.name));
    broker_ = &broker;
  }
  lanes_.set_loop(&broker);
  std::promise<void> added;
  auto f = added.get_future();
  broker.defer([this, &added] {
    broker_->add_first_participant(this);
    added.set_value();
  });
  f.wait();
}

void Pool::detach_broker() {
  Broker* b;
  {
    std::lock_guard lk(mu_);
    b = broker_;
  }
  if (!b) return;
  std::promise<void> removed;
  auto f = removed.get_future();
  if (b->try_defer([this, b, &removed] {
        b->remove_participant(this);
        removed.set_value();
      }))
    f.wait();
}

void Pool::on_shutdown_begin() {
  begin_stop();
  bool drained;
  {
    std::lock_guard lk(mu_);
    broker_told_ = true;
    drained = live_ == 0 && !drained_reported_;
    drained_reported_ = drained_reported_ || drained;
  }
  if (drained) broker_->participant_drained(this);
}

void Pool::on_shutdown_deadline() {
  std::size_t live;
  {
    std::lock_guard lk(mu_);
    live = live_;
    drained_reported_ = true;
  }
  log().warn("pool {}: broker grace period over with {} worker(s) still in a handler", opts_.name, live);
  broker_->participant_drained(this);
}

}  // namespace spindle::services
