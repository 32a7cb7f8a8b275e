// Pool: N worker threads that run messages off the broker thread.
//
// Role: the broker thread must never run user code that can block, so it
// hands messages to a Pool. Work arrives in lanes (one per service, or per
// router handle added with add_handler()); lanes.h gives the wake rule (one
// idle worker woken per message, none when all are busy) and the fairness
// rule (round-robin over lanes with work). A worker sleeps on a futex word of
// its own: no fd per thread (Mitogen spends two per sleeping thread).
//
// Stop: stop() refuses new messages (their senders get a dead "shutting down"
// reply), lets queued and running calls finish until the stop deadline, then
// answers what is still queued with a dead reply, joins the workers and runs
// the on_stopped callbacks (services' on_shutdown). It is idempotent and safe
// from any thread; inside a handler it begins the stop and returns at once
// (a worker cannot join itself; the owner's stop() or destructor joins). A
// pool attached to a Broker is stopped first when the broker shuts down.
//
// Thread safety: every public member is safe from any thread.
// Ownership: owned by the application. The Broker it is attached to, and the
// Routers it has handlers on, must outlive it.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "broker/broker.h"
#include "router/router.h"
#include "services/lanes.h"
#include "services/reasons.h"

namespace spindle::services {

struct PoolOptions {
  std::size_t threads = 4;                       // 1..kMaxThreads
  std::string name = "pool";                     // thread names: "<name>-<i>"
  std::chrono::milliseconds stop_deadline{5000};  // in-flight calls get this long
  // No thread of its own: its one worker is the thread that calls
  // serve_here() (ChildEnv::serve runs exposed functions on main's thread,
  // as Mitogen does). `threads` must then be 1.
  bool caller_thread = false;
};

class Pool : public ShutdownParticipant {
 public:
  static constexpr std::size_t kMaxThreads = 1024;
  // Runs a message on a worker. An exception escaping it is logged.
  using Job = std::function<void(Message&&)>;
  // Answers a message the pool will not run (stopping), with the reason.
  using Reject = std::function<void(Message&&, std::string_view reason)>;

  explicit Pool(PoolOptions opts = {});
  ~Pool() override;
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  Lane& add_lane(LaneOptions opts, Job run, Reject reject);
  // Queues `m` on the lane; once stopping, hands it to the lane's Reject.
  // `sender` is whose share of the lane's bounds it counts against, and
  // `uid` whose part of them that share comes from (LaneSet::push):
  // Router::share_key for what a router received.
  void submit(Lane& lane, Message&& m) {
    const std::uint64_t sender = m.header.auth_id;
    submit(lane, std::move(m), sender, process_uid());
  }
  void submit(Lane& lane, Message&& m, std::uint64_t sender, std::uint32_t uid);
  // A router handle whose messages run on this pool (not on the broker
  // thread). After stop its requests get a dead "shutting down" reply.
  std::uint32_t add_handler(Router& router, HandlerFn fn, LaneOptions lane = {},
                            HandlerOptions opts = {}, std::uint32_t handle = 0);

  // A broker shutdown stops this pool before the other participants drain.
  void attach(Broker& broker);
  Broker* attached_broker() const;
  void stop();
  // Begins the stop and returns at once (any thread, the broker's too).
  void request_stop() { begin_stop(); }
  // A caller_thread pool: runs its jobs on this thread until the pool stops.
  // Throws Error for a pool with threads of its own, or a second call.
  void serve_here();
  bool stopping() const;
  // Runs once every worker has left its loop (no handler is running).
  void on_stopped(std::function<void()> fn);

  std::size_t size() const { return opts_.threads; }
  const PoolOptions& options() const { return opts_; }
  std::vector<pid_t> worker_tids() const;  // kernel ids, for /proc
  LaneStats stats() const { return lanes_.stats(); }
  // Whether the calling thread is one of this pool's workers.
  bool on_worker_thread() const;

  // ShutdownParticipant (broker thread)
  void on_shutdown_begin() override;
  void on_shutdown_deadline() override;

 private:
  struct LaneJob {
    Job run;
    Reject reject;
  };
  void work(std::size_t index);
  void run_one(LaneSet::Taken& t);
  void worker_exited();
  void join_workers();
  void detach_broker();
  void begin_stop();

  PoolOptions opts_;
  LaneSet lanes_;
  std::vector<std::unique_ptr<LaneJob>> jobs_;  // guarded by jobs_mu_
  std::mutex jobs_mu_;

  mutable std::mutex mu_;
  std::condition_variable all_exited_cv_;
  bool stopping_ = false;
  std::atomic<bool> late_{false};
  std::atomic<bool> stopping_flag_{false};  // stopping and past the deadline: reject, don't run
  std::chrono::steady_clock::time_point stop_deadline_{};
  std::size_t live_ = 0;
  bool joined_ = false;
  bool served_ = false;  // caller_thread: a thread has taken the worker's place
  bool broker_told_ = false;
  bool drained_reported_ = false;
  std::vector<std::function<void()>> stopped_fns_;
  std::vector<pid_t> tids_;
  std::vector<std::pair<Router*, std::uint32_t>> handles_;
  Broker* broker_ = nullptr;

  std::mutex join_mu_;  // one joiner at a time
  std::vector<std::thread> threads_;
};

}  // namespace spindle::services
