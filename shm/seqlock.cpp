// The seqlock's out-of-line parts: waiting, the pid cache, the liveness test
// for a lock word's owner, and the word-wise copies.
//
// Waiting spins briefly (a writer copies a slot in well under a microsecond),
// then yields the CPU until a deadline: on a loaded machine a writer may be
// preempted inside its critical section for a whole time slice, and spinning
// through that only steals its CPU. The deadline is what makes every wait
// bounded; the caller then reports the slot busy or abandoned, never hangs.
//
// Liveness: kill(pid, 0) says whether the pid exists; a killed writer that
// nobody has reaped yet is a zombie and still "exists", so /proc/<pid>/stat is
// read for its state. A reused pid makes a dead owner look alive: the slot
// then stays busy (readers skip it, writers report kBusy) until that process
// exits too. Safe, only slower to recover. All processes sharing a buffer must
// be in one pid namespace.
#include "shm/seqlock.h"

#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <mutex>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace spindle::shm::seqlock {
namespace {

std::atomic<pid_t> g_cached_pid{0};

void forget_pid_in_child() { g_cached_pid.store(0, std::memory_order_relaxed); }

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

// State letter from /proc/<pid>/stat, or 0 if it cannot be read.
char process_state(pid_t pid) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
  int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT ? 'X' : 0;
  char buf[512];
  ssize_t n = ::read(fd, buf, sizeof buf - 1);
  ::close(fd);
  if (n <= 0) return 0;
  buf[n] = '\0';
  // "pid (comm) S ...": comm may contain ')' so take the last one.
  const char* paren = std::strrchr(buf, ')');
  if (paren == nullptr || paren[1] != ' ') return 0;
  return paren[2];
}

}  // namespace

bool Backoff::next() {
  if (spins_ < bound_.spins) {
    ++spins_;
    cpu_relax();
    return true;
  }
  auto now = std::chrono::steady_clock::now();
  if (deadline_ == std::chrono::steady_clock::time_point{}) deadline_ = now + bound_.yield_for;
  if (now >= deadline_) return false;
  ::sched_yield();
  return true;
}

pid_t self_pid() {
  pid_t pid = g_cached_pid.load(std::memory_order_relaxed);
  if (pid != 0) return pid;
  static std::once_flag registered;
  std::call_once(registered, [] { ::pthread_atfork(nullptr, nullptr, forget_pid_in_child); });
  pid = ::getpid();
  g_cached_pid.store(pid, std::memory_order_relaxed);
  return pid;
}

bool owner_alive(pid_t pid) {
  if (pid <= 0) return false;
  if (::kill(pid, 0) != 0) return errno != ESRCH;  // EPERM: exists, not ours
  char state = process_state(pid);
  return state != 'Z' && state != 'X';
}

void store_words(std::uint64_t* shared, const std::byte* src, std::size_t n) {
  std::size_t words = n / 8;
  for (std::size_t i = 0; i < words; ++i) {
    std::uint64_t w;
    std::memcpy(&w, src + i * 8, 8);
    word_ref(shared[i]).store(w, std::memory_order_release);
  }
  if (std::size_t tail = n % 8) {
    std::uint64_t w = 0;
    std::memcpy(&w, src + words * 8, tail);
    word_ref(shared[words]).store(w, std::memory_order_release);
  }
}

void load_words(const std::uint64_t* shared, std::byte* dst, std::size_t n) {
  // atomic_ref needs a non-const referent; nothing is written through it.
  auto* words_in = const_cast<std::uint64_t*>(shared);
  std::size_t words = n / 8;
  for (std::size_t i = 0; i < words; ++i) {
    std::uint64_t w = word_ref(words_in[i]).load(std::memory_order_acquire);
    std::memcpy(dst + i * 8, &w, 8);
  }
  if (std::size_t tail = n % 8) {
    std::uint64_t w = word_ref(words_in[words]).load(std::memory_order_acquire);
    std::memcpy(dst + words * 8, &w, tail);
  }
}

}  // namespace spindle::shm::seqlock
