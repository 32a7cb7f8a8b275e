// SlotBuffer across real processes (fork()): many writers and readers at once
// with a checksum per slot, and a writer killed with SIGKILL while it holds a
// slot.
//
// Children report through counters in an anonymous shared mapping and their
// exit status; no gtest macro runs inside a child, and every child ends with
// _exit(). Hang guards only: alarm() kills a test that stops making progress,
// nothing asserts on time.
//
// TSan: a child's accesses to the shared mapping are all atomic and TSan sees
// only its own process, so it has nothing to misreport across processes; the
// in-process thread test (test_slot_buffer.cpp) is where it checks the
// seqlock's ordering.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <vector>

#include <gtest/gtest.h>

#include "shm/slot_buffer.h"
#include "tests/slot_test_util.h"

namespace spindle::shm {
namespace test_slot_buffer_procs {

using testutil::stamp_slot;
using testutil::verify_stamp;

struct SharedCounters {
  std::atomic<int> stop;
  std::atomic<long> writes, write_busy, reads_ok, torn, read_busy, read_empty;
};

// Anonymous shared memory for the children's reports.
class SharedCountersMap {
 public:
  SharedCountersMap() {
    void* p = ::mmap(nullptr, sizeof(SharedCounters), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("mmap counters");
    counters_ = new (p) SharedCounters{};
  }
  ~SharedCountersMap() { ::munmap(counters_, sizeof(SharedCounters)); }
  SharedCounters& operator*() const { return *counters_; }
  SharedCounters* operator->() const { return counters_; }

 private:
  SharedCounters* counters_;
};

// Forks a child that runs fn() and _exit()s with its result (2 if it threw).
template <class Fn>
pid_t fork_worker(Fn fn) {
  pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    int rc = 2;
    try {
      rc = fn();
    } catch (...) {
    }
    ::_exit(rc);
  }
  return pid;
}

int wait_exit_code(pid_t pid) {
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// Kills the test process if it stops making progress (a reader that hangs).
struct HangGuard {
  explicit HangGuard(unsigned seconds) { ::alarm(seconds); }
  ~HangGuard() { ::alarm(0); }
};

constexpr std::size_t kSlots = 64;  // few slots: writers and readers collide often
constexpr std::size_t kSlotBytes = 248;  // 31 words: head, 29 pattern, checksum

// Writes at least `writes` slots, and goes on until the readers have checked
// kMinOkReads slots: however the scheduler interleaves the processes, reads
// and writes overlap.
constexpr long kMinOkReads = 20000;
int writer_main(SlotBuffer& buffer, SharedCounters& c, std::uint32_t id, std::uint32_t writes) {
  std::mt19937_64 rng(id);
  std::vector<std::byte> data(kSlotBytes);
  for (std::uint32_t i = 0; i < writes || c.reads_ok.load() < kMinOkReads; ++i) {
    if (i == 100 * writes) return 7;  // readers never got going
    stamp_slot(data, id, i);
    SlotStatus s = (i % 4 == 0) ? buffer.push(data).status : buffer.write(rng() % kSlots, data);
    (s == SlotStatus::kOk ? c.writes : c.write_busy).fetch_add(1);
  }
  return 0;
}

// A reader maps the buffer itself, from a duplicate of the fd: as a process
// that received the fd would.
int reader_main(int fd, SharedCounters& c, std::uint32_t id) {
  auto buffer = SlotBuffer::attach(::fcntl(fd, F_DUPFD_CLOEXEC, 3));
  std::mt19937_64 rng(1000 + id);
  std::vector<std::byte> out(kSlotBytes);
  while (c.stop.load() == 0) {
    ReadResult r = buffer->read(rng() % kSlots, out);
    if (r.status == SlotStatus::kOk)
      (r.length == kSlotBytes && verify_stamp(out) ? c.reads_ok : c.torn).fetch_add(1);
    else if (r.status == SlotStatus::kBusy)
      c.read_busy.fetch_add(1);
    else if (r.status == SlotStatus::kEmpty)
      c.read_empty.fetch_add(1);
    else
      return 3;  // kAbandoned / kTooSmall: nobody died here, sizes match
  }
  return 0;
}

TEST(SlotBufferProcs, ManyWritersAndReadersNeverSeeATornSlot) {
  HangGuard guard(120);
  auto buffer = SlotBuffer::create({kSlots, kSlotBytes});
  SharedCountersMap c;
  constexpr std::uint32_t kWriters = 4, kReaders = 4, kWrites = 5000;
  std::vector<pid_t> writers, readers;
  for (std::uint32_t r = 0; r < kReaders; ++r)
    readers.push_back(fork_worker([&, r] { return reader_main(buffer->fd(), *c, r); }));
  for (std::uint32_t w = 0; w < kWriters; ++w)
    writers.push_back(fork_worker([&, w] { return writer_main(*buffer, *c, w + 1, kWrites); }));
  for (pid_t p : writers) EXPECT_EQ(wait_exit_code(p), 0);
  c->stop = 1;
  for (pid_t p : readers) EXPECT_EQ(wait_exit_code(p), 0);

  EXPECT_EQ(c->torn.load(), 0);
  EXPECT_GE(c->writes + c->write_busy, long{kWriters} * kWrites);
  EXPECT_GT(c->writes.load(), 0);
  EXPECT_GE(c->reads_ok.load(), kMinOkReads);
  // And every slot left behind is whole.
  std::vector<std::byte> out(kSlotBytes);
  for (std::size_t i = 0; i < kSlots; ++i) {
    ReadResult r = buffer->read(i, out);
    if (r.status == SlotStatus::kOk) EXPECT_TRUE(verify_stamp(out)) << "slot " << i;
    else EXPECT_EQ(r.status, SlotStatus::kEmpty) << "slot " << i;
  }
  std::printf("writes %ld (busy %ld), reads ok %ld, busy %ld, empty %ld, torn %ld\n", c->writes.load(),
              c->write_busy.load(), c->reads_ok.load(), c->read_busy.load(), c->read_empty.load(),
              c->torn.load());
}

// A writer stops itself inside a slot's critical section (half the slot
// overwritten), then dies by SIGKILL. Readers must not hang: they report the
// slot busy while the writer lives, abandoned once it is dead (a zombie
// included); the next writer reclaims the slot and readers see whole data.
TEST(SlotBufferProcs, WriterKilledInsideASlotIsDetectedAndReclaimed) {
  HangGuard guard(60);
  auto buffer = SlotBuffer::create({16, kSlotBytes});
  buffer->set_wait_bound({64, std::chrono::microseconds(500)});
  std::vector<std::byte> before(kSlotBytes), out(kSlotBytes);
  stamp_slot(before, 1, 1);
  ASSERT_EQ(buffer->write(5, before), SlotStatus::kOk);

  pid_t child = fork_worker([&] {
    SlotWriter w = buffer->lock_slot(5);
    if (!w.held()) return 4;
    std::vector<std::byte> junk(kSlotBytes / 2, std::byte{0x5a});
    w.store(0, junk);
    ::raise(SIGSTOP);  // parked inside the critical section until killed
    return 5;          // not reached
  });
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, WUNTRACED), child);
  ASSERT_TRUE(WIFSTOPPED(status));

  // Alive but stuck: bounded waits, then busy.
  EXPECT_EQ(buffer->read(5, out).status, SlotStatus::kBusy);
  EXPECT_EQ(buffer->lock_slot(5).status(), SlotStatus::kBusy);
  EXPECT_EQ(buffer->read(6, out).status, SlotStatus::kEmpty);  // other slots unaffected

  ASSERT_EQ(::kill(child, SIGKILL), 0);
  siginfo_t info{};
  ASSERT_EQ(::waitid(P_PID, static_cast<id_t>(child), &info, WEXITED | WNOWAIT), 0);  // a zombie now
  EXPECT_EQ(buffer->read(5, out).status, SlotStatus::kAbandoned);
  ASSERT_EQ(wait_exit_code(child), 128 + SIGKILL);
  EXPECT_EQ(buffer->read(5, out).status, SlotStatus::kAbandoned);

  // A writer in another process reclaims it.
  pid_t fixer = fork_worker([&] {
    std::vector<std::byte> fresh(kSlotBytes);
    stamp_slot(fresh, 2, 2);
    return buffer->write(5, fresh) == SlotStatus::kOk ? 0 : 6;
  });
  EXPECT_EQ(wait_exit_code(fixer), 0);
  ReadResult r = buffer->read(5, out);
  ASSERT_EQ(r.status, SlotStatus::kOk);
  EXPECT_TRUE(verify_stamp(out));
  std::vector<std::byte> expected(kSlotBytes);
  stamp_slot(expected, 2, 2);
  EXPECT_EQ(out, expected);
  // And the slot works normally afterwards.
  EXPECT_EQ(buffer->write(5, before), SlotStatus::kOk);
  EXPECT_EQ(buffer->read(5, out).status, SlotStatus::kOk);
  EXPECT_EQ(out, before);
}

}  // namespace test_slot_buffer_procs
}  // namespace spindle::shm
