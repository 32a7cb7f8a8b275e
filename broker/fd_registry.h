// FdRegistry: which of this process's fds Spindle opened, so that a forked
// child can close exactly those and keep the application's.
//
// A forked child inherits every fd of its parent. The parent's Spindle fds
// (its links to other contexts, its listener, its broker's epoll, eventfd
// and timerfd, pidfds, memfds, fds in flight) must not live on in the
// child: a sibling's link held open there would hide the sibling's EOF. The
// application's fds must: its code in the child may hold their numbers.
// Closing everything, as fork_child once did, broke the second rule (the
// child's next open() took a number an inherited object still held).
//
// An entry is an fd number with the identity (st_dev, st_ino) it had when
// noted. The child closes an fd only if it still has that identity: a number
// Spindle closed and the application reused is not touched, and nothing has
// to be forgotten on close. The exception is anonymous inodes (eventfd,
// epoll, timerfd), which all share one inode: those are forgotten before
// they are closed (forget()). So is every fd a UniqueFd owns (its close
// forgets it): those are noted without an identity (note_owned), which
// keeps an fstat off the fd-passing path. Fds at or above kMaxTracked are not noted
// (the child keeps them), nor is anything when fstat fails.
//
// Thread safety: note() and forget() from any thread (atomics, no lock);
// close_noted() only in a forked child's one thread, where no lock a vanished
// thread held could block it: it reads the table without locking.
#pragma once

#include <cstddef>
#include <vector>

namespace spindle::fd_registry {

inline constexpr int kMaxTracked = 1 << 16;

// After Spindle opened `fd` (any thread).
void note(int fd);
// The same for an fd whose every close goes through forget() (a UniqueFd):
// no identity is needed, so no fstat (the fd-passing path makes two per fd).
void note_owned(int fd);
// Before Spindle closes an anonymous-inode fd it noted.
void forget(int fd);
// Whether `fd` is noted and still has the identity it was noted with.
bool is_noted(int fd);
// How a Broker finds the epoll, eventfd and timerfd Asio makes, which it
// cannot see otherwise: the kernel gives a new fd the lowest free number, so
// it takes the lowest free numbers before Asio makes them, and afterwards
// looks at those numbers only. Each costs O(1) syscalls whatever the
// process holds (a scan of /proc/self/fd cost two readlinks per open fd per
// Broker: quadratic in a process that opens many connections). An fd that
// another thread opened meanwhile on one of those numbers is taken for
// Asio's if it is an anonymous inode too, as any before/after comparison
// would take it; one Asio made beyond them is not noted (a forked child
// keeps it open, harmlessly).
//
// The `n` lowest free fd numbers, ascending (fewer if the process runs out).
std::vector<int> lowest_free_fds(int n);
// Of `numbers`, those open now on an anonymous inode ("anon_inode:[eventfd]"
// and the like), told by the anon_inodefs device (one fstat each).
std::vector<int> anon_inode_fds_among(const std::vector<int>& numbers);

// In a forked child: closes every noted fd (but `keep`) that still has its
// noted identity, then empties the table (the child's own Spindle notes its
// fds afresh). Returns how many it closed.
std::size_t close_noted(int keep);
// In a forked child that closed fds by another rule: empties the table but
// for `keep`.
void reset_to(int keep);

}  // namespace spindle::fd_registry
