// One slot per fd number: two atomics (device, inode + 1; 0 = empty). 64 Ki
// slots take 1 MiB of zero pages, of which only the touched ones are ever
// backed. Writers store the device first and the inode last (release), and
// readers load the inode first (acquire), so a slot read as set carries its
// device.
#include "broker/fd_registry.h"

#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <optional>

namespace spindle::fd_registry {
namespace {

struct Slot {
  std::atomic<std::uint64_t> dev{0};
  std::atomic<std::uint64_t> ino_plus_1{0};
};
Slot g_slots[kMaxTracked];
// ino_plus_1 of an fd noted by note_owned(): trusted without fstat.
constexpr std::uint64_t kOwned = ~std::uint64_t{0};
std::atomic<int> g_max{-1};

void raise_max(int fd) {
  int m = g_max.load(std::memory_order_relaxed);
  while (fd > m && !g_max.compare_exchange_weak(m, fd, std::memory_order_relaxed)) {
  }
}

bool identity(int fd, std::uint64_t& dev, std::uint64_t& ino) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return false;
  dev = static_cast<std::uint64_t>(st.st_dev);
  ino = static_cast<std::uint64_t>(st.st_ino);
  return true;
}

}  // namespace

void note(int fd) {
  if (fd < 0 || fd >= kMaxTracked) return;
  std::uint64_t dev, ino;
  if (!identity(fd, dev, ino)) return;
  g_slots[fd].dev.store(dev, std::memory_order_relaxed);
  g_slots[fd].ino_plus_1.store(ino + 1, std::memory_order_release);
  raise_max(fd);
}

void note_owned(int fd) {
  if (fd < 0 || fd >= kMaxTracked) return;
  g_slots[fd].ino_plus_1.store(kOwned, std::memory_order_release);
  raise_max(fd);
}

void forget(int fd) {
  if (fd < 0 || fd >= kMaxTracked) return;
  g_slots[fd].ino_plus_1.store(0, std::memory_order_release);
}

bool is_noted(int fd) {
  if (fd < 0 || fd >= kMaxTracked) return false;
  std::uint64_t want = g_slots[fd].ino_plus_1.load(std::memory_order_acquire);
  if (want == 0) return false;
  if (want == kOwned) return true;
  std::uint64_t dev, ino;
  return identity(fd, dev, ino) && ino + 1 == want &&
         dev == g_slots[fd].dev.load(std::memory_order_relaxed);
}

std::vector<int> lowest_free_fds(int n) {
  std::vector<int> out;
  // The first probe takes the lowest free number; each dup of it the next.
  const int first = ::eventfd(0, EFD_CLOEXEC);
  if (first < 0) return out;  // out of fds: nothing to find
  out.push_back(first);
  while (static_cast<int>(out.size()) < n) {
    const int fd = ::fcntl(first, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) break;
    out.push_back(fd);
  }
  for (int fd : out) ::close(fd);  // a failure leaves nothing to do
  return out;  // ascending: each number was the lowest free one then
}

std::vector<int> anon_inode_fds_among(const std::vector<int>& numbers) {
  // Every anonymous inode (epoll, eventfd, timerfd, ...) lives on the one
  // anon_inodefs superblock, so its device tells it: an fstat per number,
  // where readlink("/proc/self/fd/N") walked procfs for each (3.5% of a
  // forked worker's time in bench_forks). The device is the kernel's,
  // the same in every process: learnt once, from an eventfd of our own.
  static const std::optional<dev_t> anon_dev = []() -> std::optional<dev_t> {
    const int probe = ::eventfd(0, EFD_CLOEXEC);
    if (probe < 0) return std::nullopt;
    struct stat st;
    const bool ok = ::fstat(probe, &st) == 0;
    ::close(probe);
    return ok ? std::optional<dev_t>(st.st_dev) : std::nullopt;
  }();
  std::vector<int> out;
  if (!anon_dev) return out;  // out of fds: nothing to find (see the header)
  for (int fd : numbers) {
    struct stat st;
    if (::fstat(fd, &st) == 0 && st.st_dev == *anon_dev) out.push_back(fd);
  }
  return out;
}

void reset_to(int keep) {
  const int max = g_max.load(std::memory_order_relaxed);
  for (int fd = 0; fd <= max; ++fd) g_slots[fd].ino_plus_1.store(0, std::memory_order_relaxed);
  g_max.store(-1, std::memory_order_relaxed);
  note(keep);
}

std::size_t close_noted(int keep) {
  std::size_t closed = 0;
  const int max = g_max.load(std::memory_order_relaxed);
  for (int fd = 3; fd <= max; ++fd) {
    if (fd != keep && is_noted(fd)) {
      ::close(fd);  // a failure leaves nothing to do
      ++closed;
    }
    g_slots[fd].ino_plus_1.store(0, std::memory_order_relaxed);
  }
  g_max.store(-1, std::memory_order_relaxed);
  note(keep);  // the child's own link
  return closed;
}

}  // namespace spindle::fd_registry
