// Fast path: one compare-and-swap. Waiters announce themselves in waiters_
// before re-checking under the mutex; release() notifies only when someone
// waits, taking the mutex so the notification cannot fall between a waiter's
// check and its sleep.
//
// The announcement and the release are a store-then-load pair on each side
// (waiters_ then queued_, queued_ then waiters_): all four are seq_cst, so
// at least one side sees the other. With the level read relaxed and the
// release acq_rel, the memory model allowed both to miss (the waiter sleeps
// on a stale level, the releaser sees no waiter). x86 never does that (its
// read-modify-writes are full barriers), but weaker machines may, and on x86
// a seq_cst load costs nothing more.
#include "stream/output_gauge.h"

#include "broker/wait_hook.h"

namespace spindle {

bool OutputGauge::try_acquire(std::size_t n) {
  if (closed()) return false;
  std::size_t cur = queued_.load(std::memory_order_seq_cst);
  while (cur == 0 || cur + n <= hwm_) {
    if (queued_.compare_exchange_weak(cur, cur + n, std::memory_order_acq_rel)) return true;
  }
  return false;
}

OutputGauge::Admit OutputGauge::acquire(std::size_t n,
                                        std::chrono::steady_clock::time_point deadline) {
  if (try_acquire(n)) return Admit::kOk;
  // Declared before the lock, so a thread's hook (the binding's: let the GIL
  // go) runs outside it, and the thread takes the GIL back after unlocking.
  WaitHook::Around around;
  std::unique_lock lk(mu_);
  waiters_.fetch_add(1);
  Admit result = Admit::kTimeout;
  while (true) {
    if (closed()) {
      result = Admit::kClosed;
      break;
    }
    if (try_acquire(n)) {
      result = Admit::kOk;
      break;
    }
    if (cv_.wait_until(lk, deadline) == std::cv_status::timeout) {
      if (try_acquire(n)) result = Admit::kOk;
      else if (closed()) result = Admit::kClosed;
      break;
    }
  }
  waiters_.fetch_sub(1);
  return result;
}

void OutputGauge::release(std::size_t n) {
  queued_.fetch_sub(n, std::memory_order_seq_cst);
  if (waiters_.load(std::memory_order_seq_cst) > 0) {
    std::lock_guard lk(mu_);
    cv_.notify_all();
  }
}

void OutputGauge::close() {
  closed_.store(true, std::memory_order_release);
  std::lock_guard lk(mu_);
  cv_.notify_all();
}

}  // namespace spindle
