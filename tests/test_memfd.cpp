// Large payloads through sealed memfds (docs/PROTOCOL.md §13): the seals a
// PayloadBuffer gets, a receiver refusing an unsealed, writable or non-memfd
// body, the round trip through a forked child as a memfd (a view, not a
// copy), the inline fallback for a peer without fds, and kill -9 of either
// side mid-transfer leaving nothing in /dev/shm and no fd behind.
#include <signal.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <sys/uio.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <span>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "broker/errors.h"
#include "router/child.h"
#include "router/reasons.h"
#include "router/router.h"
#include "stream/memfd.h"
#include "tests/fds_test_util.h"
#include "tests/router_probe.h"
#include "tests/router_test_util.h"

namespace spindle {
namespace test_memfd {

using namespace std::chrono_literals;
using namespace testutil;

constexpr std::uint32_t kEcho = 3000, kDescribe = 3200, kStream = 3201, kRemember = 3202, kLast = 3203;

Payload filled_buffer(std::size_t n, std::uint32_t seed) {
  PayloadBuffer buf(n);
  auto bytes = pattern(n, seed);
  std::memcpy(buf.bytes().data(), bytes.data(), n);
  return std::move(buf).seal();
}

TEST(Memfd, PayloadBufferIsSealedNamelessAndReadOnly) {
  auto shm_before = dev_shm_entries();
  Payload p = filled_buffer(3u << 20, 5);
  ASSERT_TRUE(p.memfd());
  const int fd = p.memfd()->fd();
  EXPECT_EQ(::fcntl(fd, F_GET_SEALS) & kRequiredSeals, kRequiredSeals);
  EXPECT_TRUE(has_cloexec(fd));
  EXPECT_EQ(payload_bytes(p), pattern(3u << 20, 5));
  ASSERT_TRUE(p.contiguous().data() != nullptr) << "one view of the mapping";
  // Nobody can change it any more: not by write(), not through a new mapping.
  char x = 'x';
  EXPECT_LT(::pwrite(fd, &x, 1, 0), 0);
  EXPECT_EQ(errno, EPERM);
  void* w = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  EXPECT_EQ(w, MAP_FAILED);
  EXPECT_NE(::ftruncate(fd, 1), 0);
  EXPECT_EQ(dev_shm_entries(), shm_before) << "a memfd has no name in /dev/shm";
}

// A page of the buffer held by the kernel (here: vmsplice()d into a pipe
// that nobody reads), as reclaim or page migration hold one for a moment on
// a loaded machine, makes F_SEAL_WRITE fail with EBUSY.
class HeldPage {
 public:
  explicit HeldPage(std::span<std::uint8_t> bytes) {
    iovec iov{bytes.data(), 4096};
    if (::vmsplice(pipe_.write.get(), &iov, 1, 0) != 4096)
      throw std::system_error(errno, std::generic_category(), "vmsplice");
  }

 private:
  Pipe pipe_ = make_owned_pipe();
};

// The inode of the file mapped at `addr` (/proc/self/maps), 0 if none.
ino_t inode_mapped_at(const void* addr) {
  std::ifstream maps("/proc/self/maps");
  const auto a = reinterpret_cast<std::uintptr_t>(addr);
  for (std::string line; std::getline(maps, line);) {
    std::uintptr_t lo = 0, hi = 0;
    unsigned long long inode = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx %*s %*s %*s %llu", &lo, &hi, &inode) == 3 && a >= lo && a < hi)
      return static_cast<ino_t>(inode);
  }
  return 0;
}

// A 1 MiB PayloadBuffer filled with one byte, and the inode of its memfd.
struct FilledBuffer {
  static constexpr std::size_t kSize = 1u << 20;
  explicit FilledBuffer(char b) : buf(kSize), byte(b) {
    std::memset(buf.bytes().data(), byte, kSize);
    inode = inode_mapped_at(buf.bytes().data());
  }
  // Seals it, checks that the payload is sealed and holds the bytes, and
  // returns the inode of the payload's memfd.
  ino_t seal() {
    Payload p = std::move(buf).seal();
    if (!p.memfd()) return 0;
    EXPECT_EQ(::fcntl(p.memfd()->fd(), F_GET_SEALS) & kRequiredSeals, kRequiredSeals);
    EXPECT_EQ(p.size(), kSize);
    const auto bytes = p.contiguous();
    EXPECT_EQ(bytes[0], byte);
    EXPECT_EQ(bytes[kSize - 1], byte);
    return fd_identity(p.memfd()->fd()).second;
  }
  PayloadBuffer buf;
  char byte;
  ino_t inode = 0;
};

TEST(Memfd, ABufferThatCannotBeSealedIsSentAsASealedCopy) {
  FilledBuffer f('h');
  ASSERT_NE(f.inode, 0u);
  HeldPage held(f.buf.bytes());  // for good: the pipe is never read
  const ino_t sent = f.seal();
  EXPECT_NE(sent, 0u);
  EXPECT_NE(sent, f.inode) << "a copy, not the memfd whose page is held";
}

TEST(Memfd, ABufferStillMappedByAForkedChildIsSentAsASealedCopy) {
  FilledBuffer f('f');
  Pipe go = make_owned_pipe();
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {  // inherits the writable mapping and keeps it until told
    ::close(go.write.get());  // raw: only async-signal-safe calls in the child
    char c;
    (void)::read(go.read.get(), &c, 1);
    ::_exit(0);
  }
  go.read.reset();
  const ino_t sent = f.seal();
  go.write.reset();
  int st = 0;
  ASSERT_EQ(::waitpid(pid, &st, 0), pid);
  EXPECT_NE(sent, 0u);
  EXPECT_NE(sent, f.inode);
}

TEST(Memfd, ABufferNobodyElseHoldsIsSealedAsItIs) {
  FilledBuffer f('z');
  EXPECT_EQ(f.seal(), f.inode) << "no copy";
}

// Sealing with View::kKeepPrivate (the Python spindle.Buffer's): the
// producer's view stays mapped at the same address, and what it writes after
// sealing is its own copy, never the sealed message's bytes.
TEST(Memfd, SealingCanKeepThePrivateViewOfTheProducer) {
  const std::size_t n = 1u << 20;
  PayloadBuffer buf(n);
  std::uint8_t* view = buf.bytes().data();
  std::memset(view, 'a', n);
  Payload p = std::move(buf).seal(PayloadBuffer::View::kKeepPrivate);
  ASSERT_TRUE(p.memfd());
  EXPECT_EQ(::fcntl(p.memfd()->fd(), F_GET_SEALS) & kRequiredSeals, kRequiredSeals);
  EXPECT_EQ(buf.bytes().data(), view) << "the view stays where it was";
  EXPECT_EQ(view[n - 1], 'a') << "and shows the sealed bytes";
  std::memset(view, 'b', n);  // a write after sealing: a private copy of the pages
  EXPECT_EQ(p.contiguous()[0], 'a');
  EXPECT_EQ(p.contiguous()[n - 1], 'a') << "the message keeps what was sealed";
  EXPECT_EQ(view[0], 'b');
}

// The same when the memfd could not be sealed as it is (a process forked
// since maps it writable, so a sealed copy is sent): the kept view shows the
// bytes that were sent, never what that process writes into the old memfd
// afterwards. Before, the view was a private mapping of the old memfd, whose
// pages the producer had not written since read through to the child's writes.
TEST(Memfd, AKeptViewOfACopiedBufferShowsWhatWasSent) {
  const std::size_t n = 1u << 20;
  PayloadBuffer buf(n);
  std::uint8_t* view = buf.bytes().data();
  std::memset(view, 'a', n);
  Pipe go = make_owned_pipe(), done = make_owned_pipe();
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {  // keeps the shared writable mapping, writes when told
    ::close(go.write.get());  // raw: only async-signal-safe calls in the child
    ::close(done.read.get());
    char c;
    if (::read(go.read.get(), &c, 1) == 1) {
      for (std::size_t i = 0; i < n; i += 4096) view[i] = 'c';
      (void)::write(done.write.get(), "d", 1);
    }
    ::_exit(0);
  }
  go.read.reset();
  done.write.reset();
  const ino_t before = inode_mapped_at(view);
  Payload p = std::move(buf).seal(PayloadBuffer::View::kKeepPrivate);
  ASSERT_TRUE(p.memfd());
  EXPECT_NE(fd_identity(p.memfd()->fd()).second, before) << "a copy: the child still maps the memfd";
  ASSERT_EQ(::write(go.write.get(), "g", 1), 1);
  char c = 0;
  ASSERT_EQ(::read(done.read.get(), &c, 1), 1) << "the child wrote into its mapping";
  int st = 0;
  ASSERT_EQ(::waitpid(pid, &st, 0), pid);
  EXPECT_EQ(buf.bytes().data(), view) << "the view stays where it was";
  EXPECT_EQ(view[0], 'a') << "the kept view reads the bytes sent, not the child's later write";
  EXPECT_EQ(view[n - 4096], 'a');
  EXPECT_EQ(p.contiguous()[0], 'a');
  view[1] = 'b';  // still the producer's own private copy
  EXPECT_EQ(p.contiguous()[1], 'a');
}

TEST(Memfd, ReceiverRefusesUnsealedWritableOrForeignBodies) {
  FdRecorder rec;
  StreamHarness h;
  FdPair sp = make_socketpair();
  h.make(sp.a, sp.a, &rec);
  auto make_memfd = [](int seals) {
    UniqueFd fd(::memfd_create("test-body", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    EXPECT_EQ(::ftruncate(fd.get(), 8192), 0);
    if (seals) {
      EXPECT_EQ(::fcntl(fd.get(), F_ADD_SEALS, seals), 0);
    }
    return fd;
  };
  std::vector<UniqueFd> bodies;
  bodies.push_back(make_memfd(0));                            // unsealed
  bodies.push_back(make_memfd(F_SEAL_SHRINK | F_SEAL_GROW));  // still writable
  bodies.push_back(std::move(pipe_fds(1)[0]));                // not a memfd
  bodies.push_back(make_memfd(F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE));  // good
  for (std::size_t i = 0; i < bodies.size(); ++i) {
    int raw = bodies[i].get();
    ASSERT_TRUE(send_with_fds(sp.b, sf_frame(static_cast<std::uint32_t>(10 + i), 1, "", kFdFlagMemfdBody),
                              std::span<const int>(&raw, 1)));
  }
  ASSERT_TRUE(rec.wait_messages(1));
  ASSERT_TRUE(rec.wait_refusals(3));
  std::lock_guard lk(rec.mu);
  ASSERT_EQ(rec.refusals.size(), 3u);
  for (const std::string& why : rec.refusals) EXPECT_TRUE(contains(why, reason::kBadMemfd)) << why;
  EXPECT_TRUE(contains(rec.refusals[0], "not sealed")) << rec.refusals[0];
  EXPECT_TRUE(contains(rec.refusals[1], "not sealed")) << rec.refusals[1];
  EXPECT_TRUE(contains(rec.refusals[2], "not a memfd")) << rec.refusals[2];
  EXPECT_EQ(rec.refused[0].header.handle, 10u);
  // The stream survived, and the sealed body arrived unmapped, as an fd.
  EXPECT_EQ(rec.closed, 0);
  ASSERT_EQ(rec.messages.size(), 1u);
  EXPECT_EQ(rec.messages[0].header.handle, 13u);
  ASSERT_TRUE(rec.messages[0].sealed_body);
  EXPECT_EQ(rec.messages[0].sealed_body->size(), 8192u);
  close_fd(sp.b);
}

// The child reports how a payload arrived: "<memfd|inline> <size> <checksum>".
std::string describe(const Payload& p) {
  std::uint64_t sum = 0;
  for (const Slice& s : p.slices())
    for (std::size_t i = 0; i < s.size; ++i) sum = sum * 31 + s.data[i];
  return fmt::format("{} {} {}", p.memfd() ? "memfd" : "inline", p.size(), sum);
}

int memfd_child(ChildEnv& env) {
  Router& r = env.router();
  r.add_handler([&r](Message&& m) { r.reply(m, m.data); }, {}, kEcho);
  r.add_handler([&r](Message&& m) { r.reply(m, Payload::copy_of(describe(m.data))); }, {}, kDescribe);
  // One-way messages are described for the next kLast call (both handlers
  // run on the broker thread, in arrival order).
  std::string last;
  r.add_handler([&last](Message&& m) { last = describe(m.data); }, {}, kRemember);
  r.add_handler([&r, &last](Message&& m) { r.reply(m, Payload::copy_of(last)); }, {}, kLast);
  env.serve();
  return 0;
}

TEST(MemfdRouter, LargePayloadsTravelAsMemfdViewsBothWays) {
  Broker broker;
  Router router(broker, root_opts());
  Context c = fork_child(router, memfd_child, named("memfd-peer"));
  // Copied once into a memfd by send(): above the 1 MiB threshold.
  std::string big = std::string(4u << 20, '\0');
  for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 7 + (i >> 12));
  Payload expect = Payload::copy_of(big);
  EXPECT_EQ(c.call(kDescribe, expect, 20s).to_string(), describe(Payload::copy_of(big)).replace(0, 6, "memfd"));
  // Echoed: the child resends its view, which passes the same fd back.
  Payload back = c.call(kEcho, expect, 20s);
  EXPECT_TRUE(back.memfd()) << "the reply came inline";
  EXPECT_TRUE(back.to_string() == big);
  // A fabric buffer is never copied: the receiver maps the sender's memfd.
  Payload fabric = filled_buffer(8u << 20, 9);
  std::string want = describe(fabric);
  EXPECT_EQ(c.call(kDescribe, fabric, 20s).to_string(), want);
  // Below the threshold payloads stay inline.
  std::string small = describe(Payload::copy_of(std::string(1000, 's')));
  EXPECT_EQ(c.call(kDescribe, Payload::copy_of(std::string(1000, 's')), 10s).to_string(), small);
  c.shutdown();
  expect_exit_code(c, 0);
}

// Context::send(handle, bytes) copies small bytes straight into the send
// queue, with no Payload built; bytes above the memfd threshold still travel
// as a sealed memfd, as a Payload of that size does.
TEST(MemfdRouter, SentBytesAboveTheThresholdTravelAsAMemfd) {
  Broker broker;
  Router router(broker, root_opts());
  Context c = fork_child(router, memfd_child, named("memfd-bytes"));
  std::string big(3u << 20, '\0');
  for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 13 + (i >> 10));
  c.send(kRemember, std::string_view(big));
  EXPECT_EQ(c.call(kLast, std::string_view{}, 20s),
            describe(Payload::copy_of(big)).replace(0, 6, "memfd"));
  const std::string small(200, 'b');
  c.send(kRemember, std::string_view(small));
  EXPECT_EQ(c.call(kLast, std::string_view{}, 20s), describe(Payload::copy_of(small)));
  c.shutdown();
  expect_exit_code(c, 0);
}

// send() copies a heap payload above the threshold into a memfd and keeps a
// view of it, which only a peer without fds would read. Building that view's
// page tables (MAP_POPULATE) cost a quarter of the copy's time and made the
// sender resident in the payload twice over (its heap bytes and the view).
TEST(MemfdRouter, TheSendersCopyIntoAMemfdAddsNothingToItsResidentSet) {
  if (!kRssIsMeaningful) GTEST_SKIP() << "a sanitizer's heap makes the resident set meaningless";
  Broker broker;
  Router router(broker, root_opts());
  Context c = fork_child(router, memfd_child, named("memfd-rss"));
  constexpr std::size_t kSize = 64u << 20;
  Payload heap;
  {
    std::string big(kSize, '\0');
    for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 11 + (i >> 12));
    heap = Payload::copy_of(big);
  }
  const std::string want = describe(heap).replace(0, 6, "memfd");
  ASSERT_TRUE(reset_peak_rss()) << "cannot reset VmHWM through /proc/self/clear_refs";
  const long base_kib = vm_rss_kib(::getpid());
  EXPECT_EQ(c.call(kDescribe, heap, 20s).to_string(), want);
  const long growth = (vm_hwm_kib(::getpid()) - base_kib) * 1024;
  EXPECT_LT(growth, static_cast<long>(kSize / 4))
      << "sending " << kSize << " heap bytes through a memfd raised the sender's peak RSS by " << growth;
  c.shutdown();
  expect_exit_code(c, 0);
}

TEST(MemfdRouter, PeerWithoutFdsGetsTheBytesInline) {
  Broker broker;
  Router router(broker, root_opts());
  Context c = spawn_echo_on_pipes(router, "stdio-memfd");
  Payload fabric = filled_buffer(3u << 20, 4);
  Payload back = c.call(kEcho, fabric, 20s);
  EXPECT_EQ(payload_bytes(back), pattern(3u << 20, 4));
  c.shutdown();
  expect_exit_code(c, 0);
}

// kill -9 of the receiver, then of the sender, mid-transfer, 20 times in
// all: /dev/shm is untouched and this process's fd count returns to its
// baseline once the link has closed.
TEST(MemfdRouter, KillNineMidTransferLeavesNothingBehind) {
  Broker broker;
  Router router(broker, root_opts());
  const auto shm_before = dev_shm_entries();
  const std::size_t fds_before = count_open_fds();
  std::atomic<int> received{0};
  router.add_handler([&received](Message&& m) {
    if (m.data.size() > 0) received.fetch_add(1);
  }, {}, kStream);
  auto wait_links_closed = [&] {
    for (int i = 0; i < 2000 && router.stats().streams != 0; ++i) std::this_thread::sleep_for(5ms);
    return router.stats().streams == 0;
  };
  const std::uint32_t root = router.id();
  for (int round = 0; round < 20; ++round) {
    const bool kill_receiver = round % 2 == 0;
    Context c = fork_child(router, [root, kill_receiver](ChildEnv& env) {
      Router& r = env.router();
      r.add_handler([](Message&&) { ::pause(); }, {}, kStream);  // the receiver, killed while busy
      env.ready();
      if (!kill_receiver) {
        // The sender: 16 MiB buffers to the root until it is killed.
        for (std::uint32_t i = 0;; ++i) {
          PayloadBuffer buf(16u << 20);
          std::memset(buf.bytes().data(), static_cast<int>(i), buf.size());
          r.send(Message::make(root, kStream, std::move(buf).seal()), 30s);
        }
      }
      env.serve();
      return 0;
    }, named(fmt::format("victim-{}", round)));
    if (kill_receiver) {
      for (int i = 0; i < 3; ++i) {
        PayloadBuffer buf(16u << 20);
        std::memset(buf.bytes().data(), i, buf.size());
        router.send(Message::make(c.id(), kStream, std::move(buf).seal()));
      }
    } else {
      int start = received.load();
      for (int i = 0; i < 2000 && received.load() == start; ++i) std::this_thread::sleep_for(1ms);
    }
    ASSERT_EQ(::kill(c.pid(), SIGKILL), 0);
    auto st = c.wait_exit(20s);
    ASSERT_TRUE(st.has_value());
    EXPECT_TRUE(WIFSIGNALED(*st) && WTERMSIG(*st) == SIGKILL) << describe_wait_status(*st);
    ASSERT_TRUE(wait_links_closed()) << "round " << round;
  }
  EXPECT_GT(received.load(), 0);
  EXPECT_EQ(dev_shm_entries(), shm_before);
  // The broker reaps each child's pidfd on its own thread: give it a moment.
  std::size_t fds_after = count_open_fds();
  for (int i = 0; i < 2000 && fds_after != fds_before; ++i) {
    std::this_thread::sleep_for(5ms);
    fds_after = count_open_fds();
  }
  EXPECT_EQ(fds_after, fds_before);
}

}  // namespace test_memfd
}  // namespace spindle
