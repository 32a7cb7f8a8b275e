// Fds: file descriptors owned by a message.
//
// UniqueFd owns one descriptor and closes it exactly once. FdSet is the list a
// Message carries: immutable once built and shared by reference count, like a
// Payload's bytes, so a copied Message shares its fds instead of duplicating
// them; the descriptors close when the last holder lets go. Whatever path a
// message takes (delivered, dropped, answered with a dead reply, stranded on a
// closed stream, unwound by an exception) its fds are closed by that RAII.
//
// An FdSet may also hold a charge: an object released together with the fds
// (the router's per-peer quota of fds in flight uses it).
//
// Thread safety: UniqueFd is a plain owner (one thread at a time); an FdSet is
// immutable and may be read and dropped from any thread.
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <utility>
#include <vector>

namespace spindle {

// SCM_MAX_FD: the most fds one sendmsg may carry, so the most one message may.
inline constexpr std::size_t kMaxFdsPerMessage = 253;

class UniqueFd {
 public:
  UniqueFd() = default;
  // Takes ownership of `fd`. The fd is Spindle's from then on: a child that
  // fork_child() starts later closes it (FdPolicy), until this lets it go.
  explicit UniqueFd(int fd);
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  // Gives the fd up: the caller owns it, and it is no longer Spindle's.
  int release();
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

// A duplicate of `fd` (F_DUPFD_CLOEXEC). Throws std::system_error.
UniqueFd dup_fd(int fd);

class FdSet {
 public:
  FdSet() = default;
  explicit FdSet(std::vector<UniqueFd> fds, std::shared_ptr<void> charge = nullptr);
  // Duplicates of fds the caller keeps (each dup is CLOEXEC).
  static FdSet dup_of(std::span<const int> fds);

  std::size_t size() const { return held_ ? held_->fds.size() : 0; }
  bool empty() const { return size() == 0; }
  // Borrowed: valid while this FdSet (or a copy) lives.
  int operator[](std::size_t i) const { return held_->fds[i].get(); }
  std::vector<int> raw() const;
  // The same fds with `charge` attached (released when the last holder goes).
  FdSet with_charge(std::shared_ptr<void> charge) &&;
  // Owned duplicates, for a receiver that keeps fds beyond the message.
  std::vector<UniqueFd> dup_all() const;
  // The fds themselves, for a receiver that keeps them beyond the message
  // (the Python binding): moved out if this is the last holder, so no new
  // fd is needed (a process near RLIMIT_NOFILE cannot dup), duplicates
  // otherwise. This FdSet is empty afterwards; its charge is released.
  std::vector<UniqueFd> take_all();

 private:
  struct Held {
    std::vector<UniqueFd> fds;
    std::shared_ptr<void> charge;  // declared after fds: released after they close
    // Charged fds came from a peer (or wait in a send queue): one whose
    // close() may wait (a socket with SO_LINGER) is closed on a thread of
    // its own, not on the thread that drops the message.
    ~Held();
  };
  std::shared_ptr<Held> held_;
};

}  // namespace spindle
