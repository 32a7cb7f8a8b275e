// AdaptiveMutex: a mutex that spins a little before it sleeps (glibc's
// PTHREAD_MUTEX_ADAPTIVE_NP), for locks held only to move a few pointers.
//
// Role: the lock of a LaneSet. A producer that queues a message and a worker
// that takes one meet there for tens of nanoseconds; with std::mutex the one
// that finds it taken sleeps in the kernel, and each such meeting costs two
// context switches where waiting out the holder costs a few hundred cycles.
// bench_services' wake table, one worker: 1.7 M jobs/s with std::mutex, 3.1-
// 3.8 M with this one (docs/DESIGN.md, Services).
//
// Thread safety: as std::mutex (Lockable; wait on it with
// std::condition_variable_any). Ownership: a plain member, not movable.
#pragma once

#include <pthread.h>

#include <system_error>

namespace spindle::services {

class AdaptiveMutex {
 public:
  AdaptiveMutex() {
    pthread_mutexattr_t attr;
    int rc = pthread_mutexattr_init(&attr);
    if (rc == 0) rc = pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_ADAPTIVE_NP);
    if (rc == 0) rc = pthread_mutex_init(&m_, &attr);
    pthread_mutexattr_destroy(&attr);
    if (rc != 0) throw std::system_error(rc, std::generic_category(), "pthread_mutex_init(adaptive)");
  }
  ~AdaptiveMutex() { pthread_mutex_destroy(&m_); }
  AdaptiveMutex(const AdaptiveMutex&) = delete;
  AdaptiveMutex& operator=(const AdaptiveMutex&) = delete;

  void lock() {
    // Fails only for error-checking or robust mutexes, or EAGAIN for
    // recursive ones: none of which this is.
    if (int rc = pthread_mutex_lock(&m_); rc != 0)
      throw std::system_error(rc, std::generic_category(), "pthread_mutex_lock");
  }
  bool try_lock() { return pthread_mutex_trylock(&m_) == 0; }
  void unlock() { pthread_mutex_unlock(&m_); }

 private:
  pthread_mutex_t m_;
};

}  // namespace spindle::services
