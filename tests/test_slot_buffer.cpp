// SlotBuffer in one process: geometry and attach errors, the fd count at a
// million slots, typed records, aborted writes, and threads racing on a few
// slots (the part ThreadSanitizer can check against the memory model).
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "shm/slot_buffer.h"
#include "spindle/slots.h"
#include "tests/process_util.h"
#include "tests/slot_test_util.h"

namespace spindle::shm {
namespace test_slot_buffer {

using testutil::stamp_slot;
using testutil::verify_stamp;

// Runs fn, which must throw SlotBufferError whose what() starts with text.
template <class Fn>
void expect_slot_error(Fn fn, std::string_view text) {
  try {
    fn();
    ADD_FAILURE() << "expected SlotBufferError: " << text;
  } catch (const SlotBufferError& e) {
    EXPECT_EQ(std::string_view(e.what()).substr(0, text.size()), text) << e.what();
  }
}

int dup_fd(int fd) {
  int d = ::fcntl(fd, F_DUPFD_CLOEXEC, 3);
  if (d < 0) throw std::runtime_error("dup failed");
  return d;
}

// A memfd of `size` bytes whose first bytes are `header`, optionally sealed.
int make_memfd(std::size_t size, const SlotBufferHeader* header, bool seal) {
  int fd = ::memfd_create("slot-test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(size)) != 0) throw std::runtime_error("memfd");
  if (header && ::pwrite(fd, header, sizeof *header, 0) != sizeof *header) throw std::runtime_error("pwrite");
  if (seal && ::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) throw std::runtime_error("seal");
  return fd;
}

SlotBufferHeader header_of(const SlotBuffer& b) {
  SlotBufferHeader h;
  if (::pread(b.fd(), &h, sizeof h, 0) != sizeof h) throw std::runtime_error("pread");
  return h;
}

TEST(SlotBuffer, CreateRejectsBadGeometry) {
  expect_slot_error([] { SlotBuffer::create({0, 64}); }, errtext::kSlotGeometryInvalid);
  expect_slot_error([] { SlotBuffer::create({64, 0}); }, errtext::kSlotGeometryInvalid);
  expect_slot_error([] { SlotBuffer::create({std::size_t{1} << 60, 4096}); }, errtext::kSlotGeometryInvalid);
  expect_slot_error([] { SlotBuffer::create({1, (std::size_t{1} << 32) + 1}); }, errtext::kSlotGeometryInvalid);
}

TEST(SlotBuffer, CreatedFdIsSealedCloexecAndRoundTrips) {
  auto b = SlotBuffer::create({100, 40});
  EXPECT_EQ(b->slot_count(), 100u);
  EXPECT_EQ(b->slot_size(), 40u);
  EXPECT_EQ(::fcntl(b->fd(), F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
  int seals = ::fcntl(b->fd(), F_GET_SEALS);
  EXPECT_EQ(seals & (F_SEAL_SHRINK | F_SEAL_GROW), F_SEAL_SHRINK | F_SEAL_GROW);
  EXPECT_NE(::ftruncate(b->fd(), 0), 0);  // nobody can shrink it under a reader
  EXPECT_EQ(errno, EPERM);

  std::vector<std::byte> data(40), out(40);
  stamp_slot(data, 7, 1);
  std::vector<std::byte> too_big(41);
  EXPECT_EQ(b->read(3, out).status, SlotStatus::kEmpty);
  EXPECT_EQ(b->write(3, data), SlotStatus::kOk);
  auto peer = SlotBuffer::attach(dup_fd(b->fd()));  // a second, independent mapping
  ReadResult r = peer->read(3, out);
  EXPECT_EQ(r.status, SlotStatus::kOk);
  EXPECT_EQ(r.length, 40u);
  EXPECT_EQ(out, data);
  std::vector<std::byte> small(39);
  EXPECT_EQ(peer->read(3, small).status, SlotStatus::kTooSmall);
  EXPECT_THROW(b->write(3, too_big), std::length_error);
  EXPECT_THROW(b->write(100, data), std::out_of_range);
  EXPECT_THROW(peer->read(100, out), std::out_of_range);
}

TEST(SlotBuffer, AttachNamesWhatIsWrong) {
  auto real = SlotBuffer::create({16, 64});
  const SlotBufferHeader good = header_of(*real);

  int pipe_fds[2];
  ASSERT_EQ(::pipe2(pipe_fds, O_CLOEXEC), 0);
  ::close(pipe_fds[1]);
  expect_slot_error([&] { SlotBuffer::attach(pipe_fds[0]); }, errtext::kSlotFdTooSmall);
  EXPECT_EQ(::fcntl(pipe_fds[0], F_GETFD), -1) << "attach must close its fd on failure";

  expect_slot_error([&] { SlotBuffer::attach(make_memfd(good.total_size, &good, false)); },
                    errtext::kSlotFdNotSealed);
  expect_slot_error([&] { SlotBuffer::attach(make_memfd(good.total_size, nullptr, true)); },
                    errtext::kSlotBadMagic);
  SlotBufferHeader h = good;
  h.version = 99;
  expect_slot_error([&] { SlotBuffer::attach(make_memfd(h.total_size, &h, true)); }, errtext::kSlotBadVersion);
  h = good;
  h.slot_size = 4096;  // stride and total no longer follow from it
  expect_slot_error([&] { SlotBuffer::attach(make_memfd(h.total_size, &h, true)); }, errtext::kSlotBadGeometry);
  h = good;
  h.slot_count = std::uint64_t{1} << 62;
  expect_slot_error([&] { SlotBuffer::attach(make_memfd(good.total_size, &h, true)); },
                    errtext::kSlotBadGeometry);
  expect_slot_error([&] { SlotBuffer::attach(make_memfd(good.total_size + 4096, &good, true)); },
                    errtext::kSlotSizeMismatch);
  EXPECT_THROW(SlotBuffer::attach(-1), std::system_error);
  EXPECT_NO_THROW(SlotBuffer::attach(make_memfd(good.total_size, &good, true)));
}

struct Transition {
  static constexpr std::uint32_t kLayoutId = 1;
  std::int64_t step;
  std::int32_t action;
  std::int32_t done;
  float reward;
  float observation[12];
  std::uint8_t mask[5];
};

struct OtherRecord {
  static constexpr std::uint32_t kLayoutId = 2;
  std::int64_t value[4];
};

// Typed records go through the public RecordSlots (<spindle/slots.h>).
TEST(SlotBuffer, RecordsRoundTripAndCheckTheirLayout) {
  auto slots = spindle::RecordSlots<Transition>::create(8);
  Transition t{};
  t.step = 42;
  t.action = -3;
  t.done = 1;
  t.reward = 0.5f;
  for (int i = 0; i < 12; ++i) t.observation[i] = static_cast<float>(i) * 1.5f;
  t.mask[4] = 9;
  auto p = slots.push(t);
  EXPECT_EQ(p.status, SlotStatus::kOk);
  EXPECT_EQ(p.slot, 0u);
  EXPECT_EQ(slots.filled(), 1u);
  Transition back{};
  ASSERT_EQ(slots.read(0, back), SlotStatus::kOk);
  EXPECT_EQ(std::memcmp(&back, &t, sizeof t), 0);
  EXPECT_EQ(slots.read(1, back), SlotStatus::kEmpty);

  auto expect_layout_error = [](auto&& fn) {
    try {
      fn();
      ADD_FAILURE() << "a buffer of another layout was accepted";
    } catch (const spindle::Error& e) {
      EXPECT_EQ(std::string(e.what()).rfind(errtext::kSlotLayoutMismatch, 0), 0u) << e.what();
    }
  };
  expect_layout_error([&] { spindle::RecordSlots<OtherRecord>::attach(spindle::dup_fd(slots.buffer().fd())); });
  expect_layout_error([] {  // untagged
    spindle::RecordSlots<Transition>(spindle::SlotBuffer::create(8, sizeof(Transition)));
  });
}

TEST(SlotBuffer, PushWrapsAroundTheRing) {
  auto b = SlotBuffer::create({3, 8});
  std::byte one[8]{};
  for (std::size_t i = 0; i < 7; ++i) EXPECT_EQ(b->push(one).slot, i % 3);
  EXPECT_EQ(b->filled(), 3u);
}

TEST(SlotBuffer, UncommittedWriteLeavesTheSlotEmptyNotTorn) {
  auto b = SlotBuffer::create({4, 32});
  std::vector<std::byte> data(32), out(32);
  stamp_slot(data, 1, 1);
  ASSERT_EQ(b->write(2, data), SlotStatus::kOk);
  {
    SlotWriter w = b->lock_slot(2);
    ASSERT_TRUE(w.held());
    std::vector<std::byte> half(16, std::byte{0xee});
    w.store(0, half);
    EXPECT_THROW(w.store(3, half), std::invalid_argument);
    EXPECT_THROW(w.store(24, half), std::length_error);
    b->set_wait_bound({0, std::chrono::microseconds(0)});
    EXPECT_EQ(b->read(2, out).status, SlotStatus::kBusy);  // held by a live writer: us
    EXPECT_EQ(b->lock_slot(2).status(), SlotStatus::kBusy);
  }  // dropped without commit()
  EXPECT_EQ(b->read(2, out).status, SlotStatus::kEmpty);
  ASSERT_EQ(b->write(2, data), SlotStatus::kOk);
  EXPECT_EQ(b->read(2, out).status, SlotStatus::kOk);
  EXPECT_EQ(out, data);
}

TEST(SlotBuffer, StampDetectsATornMix) {
  std::vector<std::byte> a(256), c(256);
  stamp_slot(a, 1, 10);
  stamp_slot(c, 2, 11);
  EXPECT_TRUE(verify_stamp(a));
  std::vector<std::byte> torn(a.begin(), a.begin() + 128);
  torn.insert(torn.end(), c.begin() + 128, c.end());
  EXPECT_FALSE(verify_stamp(torn));
}

// A million slots, every one locked at the same moment: still one fd.
TEST(SlotBuffer, FdCountIsConstantAtAMillionSlots) {
  const std::size_t baseline = testutil::count_open_fds();
  auto small = SlotBuffer::create({1000, 16});
  EXPECT_EQ(testutil::count_open_fds(), baseline + 1);
  auto big = SlotBuffer::create({1'000'000, 16});
  EXPECT_EQ(testutil::count_open_fds(), baseline + 2);
  {
    std::vector<SlotWriter> held;
    held.reserve(big->slot_count());
    for (std::size_t i = 0; i < big->slot_count(); ++i) held.push_back(big->lock_slot(i));
    for (auto& w : held) ASSERT_TRUE(w.held());
    EXPECT_EQ(testutil::count_open_fds(), baseline + 2);
    std::byte v[16]{std::byte{1}};
    for (auto& w : held) {
      w.store(0, v);
      w.commit(sizeof v);
    }
  }
  std::byte out[16];
  EXPECT_EQ(big->read(999'999, out).status, SlotStatus::kOk);
  EXPECT_EQ(out[0], std::byte{1});
  small.reset();
  big.reset();
  EXPECT_EQ(testutil::count_open_fds(), baseline);
}

// Threads of one process: here TSan sees every access and checks the seqlock
// against the C++ memory model.
TEST(SlotBuffer, ThreadsNeverSeeATornSlot) {
  auto b = SlotBuffer::create({8, 120});
  std::atomic<bool> stop{false};
  std::atomic<long> torn{0}, ok{0};
  std::vector<std::thread> threads;
  for (std::uint32_t w = 0; w < 2; ++w)
    threads.emplace_back([&, w] {
      std::vector<std::byte> data(120);
      for (std::uint32_t i = 0; i < 20000; ++i) {
        stamp_slot(data, w, i);
        (void)b->write((i * 7 + w) % 8, data);
      }
    });
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      std::vector<std::byte> out(120);
      auto check = [&](std::size_t slot) {
        if (b->read(slot, out).status == SlotStatus::kOk) (verify_stamp(out) ? ok : torn).fetch_add(1);
      };
      for (std::size_t i = static_cast<std::size_t>(r); !stop.load(); ++i) check(i % 8);
      for (std::size_t i = 0; i < 8; ++i) check(i);  // once more, with the writers done
    });
  threads[0].join();
  threads[1].join();
  stop = true;
  threads[2].join();
  threads[3].join();
  EXPECT_EQ(torn.load(), 0);
  EXPECT_GT(ok.load(), 0);
}

}  // namespace test_slot_buffer
}  // namespace spindle::shm
