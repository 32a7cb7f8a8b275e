// Helpers for the fd-passing and memfd tests (test_fds.cpp, test_memfd.cpp):
// identifying an fd by what it refers to, counting this process's fds,
// listing /dev/shm, writing frames with SCM_RIGHTS from a raw far end, using
// up a process's fds, and a Recorder that also records refusals.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstring>
#include <set>
#include <stdexcept>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "stream/fd_control.h"
#include "stream/fd_frame.h"
#include "spindle/fds.h"
#include "router/child.h"
#include "tests/process_util.h"
#include "tests/raw_peer.h"
#include "tests/stream_test_util.h"

namespace spindle::testutil {

// A CLOEXEC pipe whose ends close themselves (make_pipe() gives raw fds).
struct Pipe {
  UniqueFd read, write;
};
inline Pipe make_owned_pipe() {
  int p[2];
  if (::pipe2(p, O_CLOEXEC) != 0) throw std::runtime_error("pipe2");
  return {UniqueFd(p[0]), UniqueFd(p[1])};
}

// What an fd refers to: equal for dups and for an fd passed to another process.
inline std::pair<dev_t, ino_t> fd_identity(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return {0, 0};
  return {st.st_dev, st.st_ino};
}

// The identities of a set of fds, in order.
inline std::vector<std::pair<dev_t, ino_t>> identities(const std::vector<UniqueFd>& fds) {
  std::vector<std::pair<dev_t, ino_t>> ids;
  for (const UniqueFd& f : fds) ids.push_back(fd_identity(f.get()));
  return ids;
}
inline std::vector<std::pair<dev_t, ino_t>> identities(const FdSet& fds) {
  std::vector<std::pair<dev_t, ino_t>> ids;
  for (int fd : fds.raw()) ids.push_back(fd_identity(fd));
  return ids;
}

inline bool has_cloexec(int fd) {
  int fl = ::fcntl(fd, F_GETFD);
  return fl >= 0 && (fl & FD_CLOEXEC);
}

inline std::set<std::string> dev_shm_entries() {
  std::set<std::string> names;
  if (DIR* d = ::opendir("/dev/shm")) {
    while (dirent* e = ::readdir(d))
      if (e->d_name[0] != '.') names.insert(e->d_name);
    ::closedir(d);
  }
  return names;
}

// For a child process: lowers RLIMIT_NOFILE to 64 and opens /dev/null into
// `into` until no fd is left, then gives `spare` of them back, so that the
// next fds received find exactly `spare` free slots.
inline void use_up_fds_but(std::size_t spare, std::vector<UniqueFd>& into) {
  rlimit lim{64, 64};
  ::setrlimit(RLIMIT_NOFILE, &lim);
  for (;;) {
    UniqueFd f(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    if (!f) break;
    into.push_back(std::move(f));
  }
  for (std::size_t i = 0; i < spare && !into.empty(); ++i) into.pop_back();
}

// `n` fds of fresh pipes' read ends (the write ends are closed).
inline std::vector<UniqueFd> pipe_fds(std::size_t n) {
  std::vector<UniqueFd> v;
  for (std::size_t i = 0; i < n; ++i) {
    FdPair p = make_pipe();
    v.emplace_back(p.a);
    ::close(p.b);
  }
  return v;
}

// One blocking sendmsg of `bytes` with `fds` attached (SCM_RIGHTS).
inline bool send_with_fds(int sock, std::span<const std::uint8_t> bytes, std::span<const int> fds) {
  iovec iov{const_cast<std::uint8_t*>(bytes.data()), bytes.size()};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  FdControl control;
  control.attach(mh, fds);
  return ::sendmsg(sock, &mh, MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size());
}

// The wire bytes of an SF frame: header, prefix, inline body.
inline std::vector<std::uint8_t> sf_frame(std::uint32_t handle, std::uint16_t fd_count,
                                          const std::string& body, std::uint16_t flags = 0,
                                          std::uint16_t batch_fds = 0) {
  Header h;
  h.enc = kEncFds;
  h.dst_id = 1;
  h.src_id = 2;
  h.handle = handle;
  h.reply_to = 5000;
  h.length = static_cast<std::uint32_t>(kFdPrefixSize + body.size());
  HeaderBytes hb = encode_header(h);
  auto prefix = encode_fd_prefix(FdPrefix{kEncRaw, fd_count, flags, batch_fds});
  std::vector<std::uint8_t> v(kHeaderSize + kFdPrefixSize + body.size());
  std::memcpy(v.data(), hb.data(), kHeaderSize);
  std::memcpy(v.data() + kHeaderSize, prefix.data(), kFdPrefixSize);
  if (!body.empty()) std::memcpy(v.data() + kHeaderSize + kFdPrefixSize, body.data(), body.size());
  return v;
}

// tests/helpers/spawned_echo (echo on handle 3000) over stdin/stdout: a peer
// whose transport cannot carry fds.
inline Context spawn_echo_on_pipes(Router& router, const std::string& name) {
  ChildOptions o;
  o.name = name;
  o.transport = ChildTransport::kStdio;
  return spawn_child(router, SPINDLE_HELPER_DIR "/spawned_echo", {}, o);
}

// A Recorder that also keeps what the stream refused, and why.
class FdRecorder : public Recorder {
 public:
  void on_stream_refused(Stream&, Message&& m, Refused, const std::string& why) override {
    std::lock_guard lk(mu);
    refused.push_back(std::move(m));
    refusals.push_back(why);
    cv.notify_all();
  }
  bool wait_refusals(std::size_t n) {
    return wait([&] { return refusals.size() >= n; });
  }
  std::vector<Message> refused;
  std::vector<std::string> refusals;
};

// After frames written raw to a stream on `fd`: sends a plain frame on
// handle 9999, whose delivery shows that everything before it was parsed,
// and waits for it or for the stream to close (then the write may fail).
// Returns why the stream closed ("" if it did not), and moves what it
// delivered before that frame into `delivered`.
inline std::string deliveries_before_end(int fd, FdRecorder& rec, std::vector<Message>& delivered) {
  constexpr std::uint32_t kEnd = 9999;
  Header end;
  end.dst_id = 1;
  end.src_id = 2;
  end.handle = kEnd;
  const std::string end_bytes = frame_bytes(end, "end");
  (void)!::send(fd, end_bytes.data(), end_bytes.size(), MSG_NOSIGNAL);
  rec.wait([&] { return rec.closed > 0 || (!rec.messages.empty() && rec.messages.back().header.handle == kEnd); });
  std::lock_guard lk(rec.mu);
  for (Message& m : rec.messages)
    if (m.header.handle != kEnd) delivered.push_back(std::move(m));
  return rec.closed ? rec.reason : std::string();
}

}  // namespace spindle::testutil
