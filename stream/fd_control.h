// FdControl: the ancillary data of one sendmsg or recvmsg that carries file
// descriptors (SCM_RIGHTS), so that every place that passes fds builds and
// reads the control message the same way: the streams, the zygote, the
// tests' and benches' raw peers.
//
// Thread safety: a plain buffer, one thread at a time. Ownership: holds no
// fd; attach() borrows the caller's, and for_each_received() hands each
// received fd to the caller, who owns it from then on.
#pragma once

#include <sys/socket.h>

#include <cstddef>
#include <cstring>
#include <span>

#include "spindle/fds.h"

namespace spindle {

class FdControl {
 public:
  // Attaches `fds` (at most kMaxFdsPerMessage) to `mh`, for sendmsg. With no
  // fds, `mh` carries no control message.
  void attach(msghdr& mh, std::span<const int> fds) {
    if (fds.empty()) return;
    const std::size_t bytes = sizeof(int) * fds.size();
    mh.msg_control = buf_;
    mh.msg_controllen = CMSG_SPACE(bytes);
    cmsghdr* c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(bytes);
    std::memcpy(CMSG_DATA(c), fds.data(), bytes);
  }

  // Lets `mh` receive up to kMaxFdsPerMessage fds (more: MSG_CTRUNC).
  void receive_into(msghdr& mh) {
    mh.msg_control = buf_;
    mh.msg_controllen = sizeof buf_;
  }

  // After recvmsg into `mh`: take(fd) for each fd received, in order.
  template <typename Take>
  static void for_each_received(msghdr& mh, Take&& take) {
    for (cmsghdr* c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      const std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (std::size_t i = 0; i < count; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
        take(fd);
      }
    }
  }

 private:
  alignas(cmsghdr) char buf_[CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage)];
};

}  // namespace spindle
