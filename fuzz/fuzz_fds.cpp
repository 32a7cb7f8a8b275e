// Fuzzes SF frames that carry real file descriptors (docs/PROTOCOL.md §13):
// the fuzzed child of fuzz/router_harness.h (which says it takes fds) sends
// frames whose fd prefix, declared count, memfd-body flag, inner encoding,
// destination and handle the fuzzer picks, with 0-4 real fds attached by
// SCM_RIGHTS: sealed memfds of fuzzed sizes, unsealed or write-sealed-only
// memfds, pipe ends, socket ends and /dev/null. Declared and attached counts
// may disagree, bytes may be cut, a frame may be a batch head (kFlagFdBatches:
// it takes a share of its fds and owes the rest to the SF frames after it) or
// claim fds it was sent none of, and frames go to the root (handlers, control
// handles, the pending call), to the sibling (which takes no fds) or nowhere.
// On top of the harness's invariants (sibling served, link closed on EOF,
// pending call completed, clean shutdown) this target checks that every fd
// the router received was closed again: no file the fuzzed peer sent is held
// by more of this process's fds after the input than before it. A leak is a
// crash (there is no lenient mode: the intermittent "leak" this target once
// reported was libFuzzer's own llvm-symbolizer pipes, not the router's).
#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <optional>
#include <set>
#include <utility>
#include <string>
#include <vector>

#include <fuzzer/FuzzedDataProvider.h>

#include "fuzz/router_harness.h"
#include "stream/fd_frame.h"

namespace {

using namespace spindle;

// Open files are told apart by device and inode: the router's copy of an fd
// we sent is the same open file, whatever its number. (A count of open fds
// is not enough: libFuzzer starts llvm-symbolizer with two pipes of its own
// when it first prints a new function, which once looked like a leak here.)
using FileKey = std::pair<dev_t, ino_t>;

std::optional<FileKey> key_of(int fd) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return std::nullopt;
  return FileKey{st.st_dev, st.st_ino};
}

// How many fds of this process refer to each open file.
std::map<FileKey, int> open_files() {
  std::map<FileKey, int> out;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    const int own = ::dirfd(d);
    while (dirent* e = ::readdir(d)) {
      if (e->d_name[0] == '.') continue;
      const int fd = std::atoi(e->d_name);
      if (fd == own) continue;
      if (auto k = key_of(fd)) ++out[*k];
    }
    ::closedir(d);
  }
  return out;
}

// One fd of a fuzzer-chosen kind; the caller closes it after sending.
int make_fd(FuzzedDataProvider& in) {
  switch (in.ConsumeIntegralInRange<int>(0, 5)) {
    case 0:
    case 1: {  // a memfd, sealed (or not) as the fuzzer says
      int fd = ::memfd_create("fuzz", MFD_CLOEXEC | MFD_ALLOW_SEALING);
      if (fd < 0) return -1;
      std::size_t size = in.ConsumeIntegralInRange<std::size_t>(0, 1u << 20);
      if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
        ::close(fd);
        return -1;
      }
      std::string head = in.ConsumeRandomLengthString(64);
      if (!head.empty() && size >= head.size() && ::pwrite(fd, head.data(), head.size(), 0) < 0) {
        ::close(fd);
        return -1;
      }
      static constexpr int kSeals[] = {F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE,
                                       F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL,
                                       F_SEAL_SHRINK | F_SEAL_GROW, 0};
      int seals = in.PickValueInArray(kSeals);
      if (seals && ::fcntl(fd, F_ADD_SEALS, seals) != 0) {
        ::close(fd);
        return -1;
      }
      return fd;
    }
    case 2: {
      int p[2];
      if (::pipe2(p, O_CLOEXEC) != 0) return -1;
      ::close(p[1]);
      return p[0];
    }
    case 3: {
      int sv[2];
      if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) return -1;
      ::close(sv[1]);
      return sv[0];
    }
    default:
      return ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  }
}

bool send_frame(int sock, const std::string& bytes, const std::vector<int>& fds) {
  iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  std::vector<char> control(CMSG_SPACE(sizeof(int) * (fds.empty() ? 1 : fds.size())));
  if (!fds.empty()) {
    mh.msg_control = control.data();
    mh.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  std::size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::sendmsg(sock, &mh, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<std::size_t>(n);
    iov.iov_base = const_cast<char*>(bytes.data()) + done;
    iov.iov_len = bytes.size() - done;
    mh.msg_control = nullptr;  // the fds went with the first byte
    mh.msg_controllen = 0;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::map<FileKey, int> before = open_files();
  std::set<FileKey> sent;
  FuzzedDataProvider in(data, size);
  {
    fuzz::RouterHarness h(kFlagFdPassing | kFlagFdBatches | kFlagMemfdRanges);
    static constexpr std::uint32_t kDsts[] = {0, fuzz::kSiblingId, fuzz::kFuzzedId, 77};
    static constexpr std::uint16_t kEncs[] = {kEncRaw, kEncMitogen, kEncFds, kEncCallError};
    int frames = 0;
    while (in.remaining_bytes() > 0 && frames++ < 16) {
      const std::size_t nfds = in.ConsumeIntegralInRange<std::size_t>(0, 4);
      std::vector<int> fds;
      for (std::size_t i = 0; i < nfds; ++i)
        if (int fd = make_fd(in); fd >= 0) fds.push_back(fd);
      Header hd = testutil::frame(in.PickValueInArray(kDsts), fuzz::kFuzzedId, fuzz::kFuzzedId, 0, 0,
                                  kEncFds);
      switch (in.ConsumeIntegralInRange<int>(0, 3)) {
        case 0: hd.handle = h.pending_handle(); break;
        case 1: hd.handle = in.ConsumeIntegral<std::uint32_t>(); break;
        default: hd.handle = in.ConsumeBool() ? fuzz::kEcho : 4321;
      }
      hd.reply_to = in.ConsumeBool() ? in.ConsumeIntegralInRange<std::uint32_t>(1000, 1100) : 0;
      const bool lie = in.ConsumeIntegralInRange<int>(0, 7) == 0;
      // A frame sent without fds may claim some: the rest of a batch that an
      // earlier frame's head announced (kFlagFdBatches), or a lie.
      const std::size_t count = fds.empty() ? in.ConsumeIntegralInRange<std::size_t>(1, 3) : fds.size();
      FdPrefix prefix{in.PickValueInArray(kEncs),
                      static_cast<std::uint16_t>(lie ? in.ConsumeIntegral<std::uint16_t>() : count),
                      static_cast<std::uint16_t>(in.ConsumeBool() ? kFdFlagMemfdBody : 0)};
      if (!fds.empty() && in.ConsumeIntegralInRange<int>(0, 3) == 0) {
        // A batch head: it takes a share of the fds sent with it and owes the
        // rest to the SF frames after it.
        prefix.flags |= kFdFlagBatchHead;
        prefix.batch_fds = static_cast<std::uint16_t>(lie ? in.ConsumeIntegral<std::uint16_t>() : fds.size());
        prefix.fd_count = in.ConsumeIntegralInRange<std::uint16_t>(1, static_cast<std::uint16_t>(fds.size()));
      }
      if (in.ConsumeIntegralInRange<int>(0, 15) == 0) prefix.flags = in.ConsumeIntegral<std::uint16_t>();
      // A memfd range (kFlagMemfdRanges): a descriptor that fits its memfd
      // (sizes up to 1 MiB) or not, and bytes around it.
      std::string range;
      if (prefix.memfd_body() && in.ConsumeBool()) {
        prefix.flags |= kFdFlagMemfdRange;
        const MemfdRange r{in.ConsumeIntegralInRange<std::uint64_t>(0, (1u << 20) + 2),
                           in.ConsumeIntegralInRange<std::uint64_t>(0, (1u << 20) + 2),
                           in.ConsumeIntegralInRange<std::uint32_t>(0, 80)};
        auto rb = encode_memfd_range(r);
        range.assign(reinterpret_cast<const char*>(rb.data()), rb.size());
      }
      auto pb = encode_fd_prefix(prefix);
      std::string body(reinterpret_cast<const char*>(pb.data()), pb.size());
      body += range;
      if (in.ConsumeIntegralInRange<int>(0, 15) == 0) body.resize(in.ConsumeIntegralInRange<std::size_t>(0, body.size()));
      body += in.ConsumeRandomLengthString(128);
      for (int fd : fds)
        if (auto k = key_of(fd)) sent.insert(*k);
      bool ok = send_frame(h.fuzzed().fd, testutil::frame_bytes(hd, body), fds);
      for (int fd : fds) ::close(fd);
      if (!ok) break;
    }
    h.finish();
  }
  // Every fd the router was given is closed again (checked once the
  // harness's threads and sockets are gone): no file we sent is held by
  // more fds of this process than before the input.
  const std::map<FileKey, int> after = open_files();
  for (const FileKey& k : sent) {
    auto was = before.find(k), is = after.find(k);
    const int n_before = was == before.end() ? 0 : was->second;
    const int n_after = is == after.end() ? 0 : is->second;
    if (n_after > n_before) {
      std::fprintf(stderr, "fuzz_fds: a file sent by the fuzzed peer (dev %lu inode %lu) is held by %d fd(s), %d before\n",
                   static_cast<unsigned long>(k.first), static_cast<unsigned long>(k.second), n_after, n_before);
      fuzz::fail("an fd received by the router was never closed");
    }
  }
  return 0;
}
