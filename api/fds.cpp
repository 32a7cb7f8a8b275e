// Fds are closed by their owners' destructors; a failing close() is not
// retried (on Linux the descriptor is gone either way), only counted as the
// caller's problem if it matters, which for a received fd it never does.
#include "spindle/fds.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>
#include <utility>

#include "broker/fd_closer.h"
#include "broker/fd_registry.h"
#include "broker/sole_owner.h"

namespace spindle {

UniqueFd::UniqueFd(int fd) : fd_(fd) { fd_registry::note_owned(fd); }

int UniqueFd::release() {
  fd_registry::forget(fd_);
  return std::exchange(fd_, -1);
}

void UniqueFd::reset(int fd) {
  if (fd_ >= 0) {
    fd_registry::forget(fd_);
    ::close(fd_);
  }
  fd_ = fd;
  fd_registry::note_owned(fd);
}

UniqueFd dup_fd(int fd) {
  int d = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (d < 0) throw std::system_error(errno, std::generic_category(), "fcntl(F_DUPFD_CLOEXEC)");
  return UniqueFd(d);
}

FdSet::Held::~Held() {
  fd_closer::close_received(std::move(fds), std::move(charge));
}

FdSet::FdSet(std::vector<UniqueFd> fds, std::shared_ptr<void> charge) {
  if (fds.empty() && !charge) return;
  held_ = std::make_shared<Held>();
  held_->fds = std::move(fds);
  held_->charge = std::move(charge);
}

FdSet FdSet::dup_of(std::span<const int> fds) {
  std::vector<UniqueFd> v;
  v.reserve(fds.size());
  for (int fd : fds) v.push_back(dup_fd(fd));
  return FdSet(std::move(v));
}

std::vector<int> FdSet::raw() const {
  std::vector<int> v;
  if (!held_) return v;
  for (const UniqueFd& f : held_->fds) v.push_back(f.get());
  return v;
}

FdSet FdSet::with_charge(std::shared_ptr<void> charge) && {
  if (!held_) return FdSet({}, std::move(charge));
  if (sole_owner(held_)) {
    // Charged already (the receiving stream's fd budget): both charges go
    // with the fds.
    if (held_->charge)
      charge = std::make_shared<std::pair<std::shared_ptr<void>, std::shared_ptr<void>>>(
          std::move(held_->charge), std::move(charge));
    held_->charge = std::move(charge);
    return std::move(*this);
  }
  // Shared with another holder: the charge goes with duplicates of our own.
  return FdSet(dup_all(), std::move(charge));
}

std::vector<UniqueFd> FdSet::dup_all() const {
  std::vector<UniqueFd> v;
  if (!held_) return v;
  for (const UniqueFd& f : held_->fds) v.push_back(dup_fd(f.get()));
  return v;
}

std::vector<UniqueFd> FdSet::take_all() {
  std::shared_ptr<Held> h = std::move(held_);
  if (!h) return {};
  // Only the holders can copy `held_`: with one left (this one), no copy
  // can appear while the fds move out.
  if (sole_owner(h)) return std::move(h->fds);
  std::vector<UniqueFd> v;
  for (const UniqueFd& f : h->fds) v.push_back(dup_fd(f.get()));
  return v;
}

}  // namespace spindle
