// A SlotBuffer is one sealed memfd: a 4 KiB header, then slot_count slots of
// slot_stride bytes. Each slot is [lock word][meta word][data ...], rounded
// up to 64 bytes so neighbouring small slots do not share a cache line. The
// lock word is the slot's seqlock (shm/seqlock.h); the meta word holds the
// stored length and a "valid" bit, written under the lock with the data, so
// a read copies length and bytes in one consistent snapshot.
//
// Writing: CAS the lock word from even/free to odd/our pid, store meta and
// data as atomic words, release-store the next even sequence with owner 0.
// A writer that finds the slot odd waits a bounded time; if the owner pid is
// then dead it reclaims the slot by CAS to a new odd sequence under its own
// pid (the sequence moves on, so a reader that started before can never take
// the old bytes for a stable copy) and rewrites the whole slot.
//
// Reading: load the word (acquire); even and non-zero means stable; copy meta
// and data; load the word again; equal means the copy is consistent. An odd
// word is waited on within the bound, then reported kBusy or, if its owner is
// dead, kAbandoned. A reader never writes shared memory.
//
// Why one memfd and no per-slot kernel object: the fd count must not grow
// with the slot count (a multiprocessing.Lock per slot exhausts open files at
// 100,000 slots). Sealing F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL keeps the
// size fixed for every process that maps it, so nobody can provoke SIGBUS.
#include "shm/slot_buffer.h"

#include "broker/fd_registry.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <system_error>

#include <fmt/format.h>

namespace spindle::shm {
namespace {

constexpr std::size_t kSlotControlBytes = 16;  // lock word + meta word
constexpr std::uint64_t kMetaValid = std::uint64_t{1} << 32;
constexpr unsigned kRequiredSeals = F_SEAL_SHRINK | F_SEAL_GROW;
constexpr std::uint64_t kMaxSlotSize = std::uint64_t{1} << 32;  // length fits the meta word

[[noreturn]] void throw_errno(const char* what) {
  throw std::system_error(errno, std::generic_category(), what);
}

[[noreturn]] void fail(std::string_view text, const std::string& detail) {
  throw SlotBufferError(fmt::format("{}: {}", text, detail));
}

// Stride for a payload size, or 0 if it would overflow.
std::uint64_t stride_for(std::uint64_t slot_size) {
  if (slot_size == 0 || slot_size > kMaxSlotSize) return 0;
  std::uint64_t bytes = kSlotControlBytes + ((slot_size + 7) & ~std::uint64_t{7});
  return (bytes + 63) & ~std::uint64_t{63};
}

// Total mapping size for a geometry, or 0 if invalid or overflowing.
std::uint64_t total_for(std::uint64_t slot_count, std::uint64_t stride) {
  if (slot_count == 0 || stride == 0) return 0;
  constexpr std::uint64_t kMax = static_cast<std::uint64_t>(std::numeric_limits<off_t>::max());
  if (slot_count > (kMax - SlotBufferHeader::kSize) / stride) return 0;
  return SlotBufferHeader::kSize + slot_count * stride;
}

void* map_shared(int fd, std::size_t size) {
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) throw_errno("mmap slot buffer");
  return p;
}

// Closes fd unless disarmed: attach() owns its fd even when it throws.
struct FdGuard {
  int fd;
  ~FdGuard() {
    if (fd >= 0) ::close(fd);
  }
};

// Checks the header fields against each other and the fd size. Reads a
// private copy, so the checks and the later use see the same values.
void validate(const SlotBufferHeader& h, std::uint64_t file_size) {
  if (h.magic != SlotBufferHeader::kMagic) fail(errtext::kSlotBadMagic, fmt::format("{:#x}", h.magic));
  if (h.version != SlotBufferHeader::kVersion)
    fail(errtext::kSlotBadVersion, fmt::format("buffer has {}, this program speaks {}", h.version,
                                               SlotBufferHeader::kVersion));
  std::uint64_t stride = stride_for(h.slot_size);
  std::uint64_t total = total_for(h.slot_count, stride);
  if (h.header_size != SlotBufferHeader::kSize || stride == 0 || h.slot_stride != stride || total == 0 ||
      h.total_size != total)
    fail(errtext::kSlotBadGeometry,
         fmt::format("header_size={} slot_count={} slot_size={} slot_stride={} total_size={}", h.header_size,
                     h.slot_count, h.slot_size, h.slot_stride, h.total_size));
  if (h.total_size != file_size)
    fail(errtext::kSlotSizeMismatch, fmt::format("header says {} bytes, fd has {}", h.total_size, file_size));
}

}  // namespace

std::unique_ptr<SlotBuffer> SlotBuffer::create(const SlotGeometry& g) {
  std::uint64_t stride = stride_for(g.slot_size);
  std::uint64_t total = total_for(g.slot_count, stride);
  if (total == 0 || total > std::numeric_limits<std::size_t>::max())
    fail(errtext::kSlotGeometryInvalid, fmt::format("slot_count={} slot_size={}", g.slot_count, g.slot_size));
  FdGuard guard{::memfd_create("spindle-slots", MFD_CLOEXEC | MFD_ALLOW_SEALING)};
  fd_registry::note(guard.fd);
  if (guard.fd < 0) throw_errno("memfd_create");
  if (::ftruncate(guard.fd, static_cast<off_t>(total)) != 0) throw_errno("ftruncate slot buffer");
  if (::fcntl(guard.fd, F_ADD_SEALS, kRequiredSeals | F_SEAL_SEAL) != 0) throw_errno("seal slot buffer");
  void* map = map_shared(guard.fd, total);
  // A fresh memfd reads as zeros: every slot is free, sequence 0 (empty).
  SlotBufferHeader h{};
  h.magic = SlotBufferHeader::kMagic;
  h.version = SlotBufferHeader::kVersion;
  h.header_size = SlotBufferHeader::kSize;
  h.slot_count = g.slot_count;
  h.slot_size = g.slot_size;
  h.slot_stride = stride;
  h.total_size = total;
  h.layout_tag = g.layout_tag;
  std::memcpy(map, &h, sizeof h);
  int fd = guard.fd;
  guard.fd = -1;
  return std::unique_ptr<SlotBuffer>(new SlotBuffer(fd, map, total, h));
}

std::unique_ptr<SlotBuffer> SlotBuffer::attach(int fd) {
  FdGuard guard{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw_errno("fstat slot buffer fd");
  auto file_size = static_cast<std::uint64_t>(st.st_size);
  if (file_size < SlotBufferHeader::kSize)
    fail(errtext::kSlotFdTooSmall, fmt::format("{} bytes, need at least {}", file_size, SlotBufferHeader::kSize));
  // Unsealed, the size could change under us and turn an access into SIGBUS.
  int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0 && errno != EINVAL) throw_errno("F_GET_SEALS");
  if (seals < 0 || (static_cast<unsigned>(seals) & kRequiredSeals) != kRequiredSeals)
    fail(errtext::kSlotFdNotSealed, seals < 0 ? "fd cannot be sealed" : fmt::format("seals={:#x}", seals));
  void* map = map_shared(fd, file_size);
  SlotBufferHeader h;
  std::memcpy(&h, map, sizeof h);
  try {
    validate(h, file_size);
  } catch (...) {
    ::munmap(map, file_size);
    throw;
  }
  guard.fd = -1;
  return std::unique_ptr<SlotBuffer>(new SlotBuffer(fd, map, file_size, h));
}

SlotBuffer::SlotBuffer(int fd, void* map, std::size_t map_size, const SlotBufferHeader& h)
    : fd_(fd),
      map_(map),
      map_size_(map_size),
      slot_count_(h.slot_count),
      slot_size_(h.slot_size),
      slot_stride_(h.slot_stride),
      layout_tag_(h.layout_tag) {}

SlotBuffer::~SlotBuffer() {
  ::munmap(map_, map_size_);
  ::close(fd_);
}

std::uint64_t* SlotBuffer::slot_words(std::size_t slot) const {
  if (slot >= slot_count_)
    throw std::out_of_range(fmt::format("{}: {} of {}", errtext::kSlotIndexOutOfRange, slot, slot_count_));
  auto* base = static_cast<std::byte*>(map_) + SlotBufferHeader::kSize + slot * slot_stride_;
  return reinterpret_cast<std::uint64_t*>(base);
}

SlotWriter SlotBuffer::lock_slot(std::size_t slot) {
  std::uint64_t* words = slot_words(slot);
  auto lock = seqlock::word_ref(words[0]);
  const pid_t self = seqlock::self_pid();
  seqlock::Backoff backoff(bound_);
  std::uint64_t w = lock.load(std::memory_order_acquire);
  for (;;) {
    if (!seqlock::is_locked(w)) {
      std::uint32_t odd = seqlock::seq_of(w) + 1;
      if (lock.compare_exchange_weak(w, seqlock::make_word(odd, self), std::memory_order_acq_rel,
                                     std::memory_order_acquire))
        return SlotWriter(words, odd, slot_size_);
      continue;  // w was reloaded by the failed CAS
    }
    if (backoff.next()) {
      w = lock.load(std::memory_order_acquire);
      continue;
    }
    if (seqlock::owner_alive(seqlock::owner_of(w))) return SlotWriter(nullptr, 0, 0);
    // The owner died inside the slot: take it over under a new odd sequence.
    std::uint32_t odd = seqlock::seq_of(w) + 2;
    if (lock.compare_exchange_strong(w, seqlock::make_word(odd, self), std::memory_order_acq_rel,
                                     std::memory_order_acquire))
      return SlotWriter(words, odd, slot_size_);
    backoff.restart();  // someone else moved it: wait for them
  }
}

SlotStatus SlotBuffer::write(std::size_t slot, std::span<const std::byte> data) {
  if (data.size() > slot_size_)
    throw std::length_error(fmt::format("{}: {} > {}", errtext::kSlotDataTooLarge, data.size(), slot_size_));
  SlotWriter w = lock_slot(slot);
  if (!w.held()) return SlotStatus::kBusy;
  w.store(0, data);
  w.commit(data.size());
  return SlotStatus::kOk;
}

PushResult SlotBuffer::push(std::span<const std::byte> data) {
  std::uint64_t ticket =
      std::atomic_ref<std::uint64_t>(header().next_push).fetch_add(1, std::memory_order_relaxed);
  auto slot = static_cast<std::size_t>(ticket % slot_count_);
  return {write(slot, data), slot};
}

std::size_t SlotBuffer::filled() const {
  std::uint64_t n = std::atomic_ref<std::uint64_t>(header().next_push).load(std::memory_order_relaxed);
  return n < slot_count_ ? static_cast<std::size_t>(n) : slot_count_;
}

ReadResult SlotBuffer::read(std::size_t slot, std::span<std::byte> out) const {
  std::uint64_t* words = slot_words(slot);
  auto lock = seqlock::word_ref(words[0]);
  seqlock::Backoff backoff(bound_);
  for (;;) {
    std::uint64_t before = lock.load(std::memory_order_acquire);
    if (seqlock::is_locked(before)) {
      if (backoff.next()) continue;
      bool alive = seqlock::owner_alive(seqlock::owner_of(before));
      return {alive ? SlotStatus::kBusy : SlotStatus::kAbandoned, 0};
    }
    if (seqlock::seq_of(before) == 0) return {SlotStatus::kEmpty, 0};
    std::uint64_t meta = seqlock::word_ref(words[1]).load(std::memory_order_acquire);
    auto length = static_cast<std::size_t>(meta & 0xffffffffu);
    bool fits = length <= out.size() && length <= slot_size_;
    if ((meta & kMetaValid) && fits) seqlock::load_words(words + 2, out.data(), length);
    if (lock.load(std::memory_order_acquire) != before) {
      if (backoff.next()) continue;
      return {SlotStatus::kBusy, 0};  // rewritten over and over: a live writer
    }
    if (!(meta & kMetaValid)) return {SlotStatus::kEmpty, 0};
    return {fits ? SlotStatus::kOk : SlotStatus::kTooSmall, length};
  }
}

SlotWriter::SlotWriter(SlotWriter&& other) noexcept
    : slot_(other.slot_), odd_seq_(other.odd_seq_), capacity_(other.capacity_) {
  other.slot_ = nullptr;
}

SlotWriter::~SlotWriter() {
  if (slot_) release(0);  // uncommitted: readers see kEmpty, never half a write
}

void SlotWriter::store(std::size_t offset, std::span<const std::byte> bytes) {
  if (!slot_) throw std::logic_error("SlotWriter::store on a slot that is not held");
  if (offset % 8 != 0) throw std::invalid_argument(std::string(errtext::kSlotUnalignedStore));
  if (offset > capacity_ || bytes.size() > capacity_ - offset)
    throw std::length_error(
        fmt::format("{}: {} + {} > {}", errtext::kSlotDataTooLarge, offset, bytes.size(), capacity_));
  seqlock::store_words(slot_ + 2 + offset / 8, bytes.data(), bytes.size());
}

void SlotWriter::commit(std::size_t length) {
  if (!slot_) throw std::logic_error("SlotWriter::commit on a slot that is not held");
  if (length > capacity_)
    throw std::length_error(fmt::format("{}: {} > {}", errtext::kSlotDataTooLarge, length, capacity_));
  release(kMetaValid | length);
}

void SlotWriter::release(std::uint64_t meta) {
  seqlock::word_ref(slot_[1]).store(meta, std::memory_order_release);
  seqlock::word_ref(slot_[0]).store(seqlock::make_word(seqlock::next_even(odd_seq_), 0),
                                    std::memory_order_release);
  slot_ = nullptr;
}

}  // namespace spindle::shm
