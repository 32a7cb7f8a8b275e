// What a forked child keeps of its parent's fds (FdPolicy), checked in the
// child's own /proc/self/fd: the default closes exactly what Spindle opened
// in the parent (here: the link to a sibling, the broker's fds) and keeps
// what the application opened, at the same numbers; close_all_except keeps
// only what it names; inherit_all keeps everything.
#include <dirent.h>
#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <spindle/spindle.h>

#include "broker/broker.h"
#include "broker/fd_registry.h"

namespace test_fd_policy {

// fd -> "dev:ino", as this process sees it.
using FdMap = std::map<int, std::string>;

FdMap open_fds() {
  FdMap out;
  DIR* d = ::opendir("/proc/self/fd");
  if (!d) return out;
  for (dirent* e; (e = ::readdir(d));) {
    if (e->d_name[0] == '.') continue;
    const int fd = std::atoi(e->d_name);
    struct stat st;
    if (fd != ::dirfd(d) && ::fstat(fd, &st) == 0)
      out[fd] = std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino);
  }
  ::closedir(d);
  return out;
}

inline constexpr spindle::method<FdMap()> list_fds{"list_fds"};

int lister(spindle::ChildEnv& env) {
  env.expose(list_fds, [] { return open_fds(); });
  return env.serve();
}

struct FdPolicyTest : ::testing::Test {
  void SetUp() override {
    mine = ::open("/dev/null", O_RDONLY);  // the application's, no O_CLOEXEC
    mine_cloexec = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    ASSERT_GE(mine, 0);
    ASSERT_GE(mine_cloexec, 0);
    sibling = rt.fork_child(lister, {.name = "sibling"});
    sibling.call(list_fds);  // its link is up
  }
  void TearDown() override {
    ::close(mine);
    ::close(mine_cloexec);
  }
  // The parent's fds that Spindle noted, with their identities.
  FdMap spindle_fds() const {
    FdMap out;
    for (auto& [fd, id] : open_fds())
      if (spindle::fd_registry::is_noted(fd)) out[fd] = id;
    return out;
  }
  spindle::Runtime rt;
  spindle::Child sibling;
  int mine = -1, mine_cloexec = -1;
};

bool holds(const FdMap& fds, int fd, const std::string& id) {
  auto it = fds.find(fd);
  return it != fds.end() && it->second == id;
}

// The sockets among `fds` (in this process): unlike anonymous inodes,
// which all share one identity, each socket's identity is its own.
FdMap sockets_of(const FdMap& fds) {
  FdMap out;
  for (auto& [fd, id] : fds) {
    struct stat st;
    if (::fstat(fd, &st) == 0 && S_ISSOCK(st.st_mode)) out[fd] = id;
  }
  return out;
}

// How many of `theirs` (by identity) `child` holds.
std::size_t shared(const FdMap& child, const FdMap& theirs) {
  std::size_t n = 0;
  for (auto& [fd, id] : theirs)
    for (auto& [cfd, cid] : child) n += cid == id;
  return n;
}

TEST_F(FdPolicyTest, DefaultClosesSpindlesFdsAndKeepsTheApplications) {
  const FdMap parent = open_fds();
  const FdMap ours = spindle_fds();
  ASSERT_GE(ours.size(), 2u) << "the parent should hold Spindle fds (a link, the broker's)";
  EXPECT_FALSE(ours.count(mine));
  spindle::Child c = rt.fork_child(lister);
  const FdMap child = c.call(list_fds);
  EXPECT_TRUE(holds(child, mine, parent.at(mine))) << "the application's fd is gone or renumbered";
  EXPECT_TRUE(holds(child, mine_cloexec, parent.at(mine_cloexec)));
  // No socket of the parent's Spindle (a sibling's link): anonymous inodes
  // (the broker's eventfd, epoll) all look alike, and the child has its own.
  const FdMap links = sockets_of(ours);
  ASSERT_FALSE(links.empty());
  EXPECT_EQ(shared(child, links), 0u) << "the child holds a socket of the parent's Spindle";
}

TEST_F(FdPolicyTest, CloseAllExceptKeepsOnlyWhatItNames) {
  const FdMap parent = open_fds();
  spindle::Child c =
      rt.fork_child(lister, {.fds = spindle::FdPolicy::close_all_except({mine})});
  const FdMap child = c.call(list_fds);
  EXPECT_TRUE(holds(child, mine, parent.at(mine)));
  EXPECT_FALSE(holds(child, mine_cloexec, parent.at(mine_cloexec)));
  EXPECT_EQ(shared(child, sockets_of(spindle_fds())), 0u);
}

TEST_F(FdPolicyTest, InheritAllKeepsEverything) {
  const FdMap ours = spindle_fds();
  spindle::Child c = rt.fork_child(lister, {.fds = spindle::FdPolicy::inherit_all()});
  const FdMap child = c.call(list_fds);
  EXPECT_TRUE(holds(child, mine_cloexec, open_fds().at(mine_cloexec)));
  std::size_t kept = 0;
  for (auto& [fd, id] : ours) kept += holds(child, fd, id);
  EXPECT_EQ(kept, ours.size());
}

TEST(FdRegistry, ANumberReusedByTheApplicationIsNotClosed) {
  int fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  spindle::fd_registry::note(fd);
  EXPECT_TRUE(spindle::fd_registry::is_noted(fd));
  ::close(fd);
  int again = ::open("/proc/self/stat", O_RDONLY | O_CLOEXEC);  // likely the same number
  ASSERT_GE(again, 0);
  if (again == fd) {
    EXPECT_FALSE(spindle::fd_registry::is_noted(again)) << "another file at a noted number";
  }
  ::close(again);
  spindle::fd_registry::forget(fd);
}

// A Broker finds the fds Asio makes (epoll, eventfd, timerfd) among the
// lowest free numbers (fd_registry.h), however many fds the process holds
// and wherever its holes are; a forked child closes what is noted.
TEST(FdRegistry, ABrokerNotesTheFdsAsioMakesInAProcessFullOfFds) {
  std::vector<int> held;
  for (int i = 0; i < 2000; ++i) {
    const int fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    ASSERT_GE(fd, 0);
    held.push_back(fd);
  }
  for (std::size_t i : {100u, 700u, 1500u}) {  // holes, where the new fds land
    ::close(held[i]);
    held[i] = -1;
  }
  const FdMap before = open_fds();
  {
    spindle::Broker broker;
    const FdMap after = open_fds();
    std::map<std::string, int> kinds;
    for (auto& [fd, id] : after) {
      if (before.count(fd)) continue;
      char target[64] = {};
      const ssize_t n = ::readlink(("/proc/self/fd/" + std::to_string(fd)).c_str(), target, sizeof target - 1);
      ASSERT_GT(n, 0);
      kinds[target] = fd;
      EXPECT_TRUE(spindle::fd_registry::is_noted(fd)) << "fd " << fd << " (" << target << ") is not noted";
    }
    EXPECT_TRUE(kinds.count("anon_inode:[eventpoll]")) << "no epoll fd appeared";
    EXPECT_TRUE(kinds.count("anon_inode:[timerfd]")) << "no timerfd appeared";
    EXPECT_TRUE(kinds.count("anon_inode:[eventfd]")) << "no eventfd appeared";
  }
  for (int fd : held)
    if (fd >= 0) ::close(fd);
}

// Only anonymous inodes are taken for Asio's: not a pipe, a file or a
// socket that another thread opened on one of the probed numbers, and not
// a number that is closed.
TEST(FdRegistry, OnlyAnonymousInodesCountAsAsios) {
  int p[2], sv[2];
  ASSERT_EQ(::pipe2(p, O_CLOEXEC), 0);
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  const int file = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  const int ev = ::eventfd(0, EFD_CLOEXEC);
  const int ep = ::epoll_create1(EPOLL_CLOEXEC);
  const int tm = ::timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC);
  ASSERT_GE(file, 0);
  ASSERT_GE(ev, 0);
  ASSERT_GE(ep, 0);
  ASSERT_GE(tm, 0);
  const int closed = ::dup(file);
  ASSERT_GE(closed, 0);
  ::close(closed);
  EXPECT_EQ(spindle::fd_registry::anon_inode_fds_among({p[0], sv[0], file, ev, closed, ep, tm, p[1]}),
            (std::vector<int>{ev, ep, tm}));
  for (int fd : {p[0], p[1], sv[0], sv[1], file, ev, ep, tm}) ::close(fd);
}

}  // namespace test_fd_policy
