// WaitHook: what a thread lets go of while a send waits for queue space.
//
// Role: a thread that holds something other threads need, Python's
// interpreter lock above all, must not keep it while it sleeps. The binding
// used to let the GIL go around every send and call, in case it waited; with
// a thread that completes futures waiting for the GIL, each let-go became a
// hand-off between the two threads (futex wakes and context switches on
// every call, half the parent's CPU with 1,000 calls in flight). Now it keeps
// the GIL and installs a hook instead: the two places where a send can sleep
// (OutputGauge::acquire over a high-water mark, Outbox::push on a full ring)
// run the hook's release before they sleep and its reacquire after, outside
// any lock of ours, so a thread that waits for the GIL never holds a lock
// the broker needs.
//
// Thread safety: the hook is per thread (thread_local); install it with
// WaitHook::Scope on the thread that sends. Ownership: the Scope borrows the
// hook, which must outlive it.
#pragma once

namespace spindle {

struct WaitHook {
  void (*release)(void* arg) = nullptr;    // before the thread sleeps
  void (*reacquire)(void* arg) = nullptr;  // after it wakes
  void* arg = nullptr;

  // Installs `hook` on this thread for the scope's lifetime (nesting
  // restores the outer one).
  class Scope {
   public:
    explicit Scope(WaitHook& hook) : outer_(current()) { current() = &hook; }
    ~Scope() { current() = outer_; }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    WaitHook* outer_;
  };

  // Held by a waiter around its sleep: runs this thread's hook, if any.
  class Around {
   public:
    Around() : hook_(current()) {
      if (hook_) {
        current() = nullptr;  // a wait inside the release runs no hook again
        hook_->release(hook_->arg);
      }
    }
    ~Around() {
      if (hook_) {
        hook_->reacquire(hook_->arg);
        current() = hook_;
      }
    }
    Around(const Around&) = delete;
    Around& operator=(const Around&) = delete;

   private:
    WaitHook* hook_;
  };

 private:
  static WaitHook*& current() {
    thread_local WaitHook* hook = nullptr;
    return hook;
  }
};

}  // namespace spindle
