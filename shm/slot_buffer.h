// SlotBuffer: fixed-size slots in shared memory that several processes write
// and sample concurrently (the replay-buffer case).
//
// Role: one memfd (MFD_CLOEXEC | MFD_ALLOW_SEALING, sealed against shrinking
// and growing, so no process can truncate it under the others and make them
// fault with SIGBUS; no name in /dev/shm) holds a header and N slots. Each
// slot begins with its own seqlock word (shm/seqlock.h): zero fds per lock,
// whatever the slot count. create() makes a buffer and its fd; attach() maps
// one from an fd received from another process, after checking the header
// (magic, version, geometry, size against fstat, seals).
//
// Readers never see a torn slot: read() returns kOk with a consistent copy,
// or a status (kEmpty, kBusy, kAbandoned, kTooSmall) after a bounded wait.
// A writer that died inside a slot leaves it locked under its pid: readers
// report kAbandoned, and the next writer of that slot reclaims it (see
// docs/DESIGN.md, Shared slot buffer).
//
// Thread safety: every method may be called from any thread of any process
// that maps the buffer. Ownership: a SlotBuffer owns its mapping and its fd;
// a SlotWriter borrows its SlotBuffer, which must outlive it. The geometry is
// copied out of the header once at attach, so a peer scribbling on the shared
// header later cannot move our bounds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

#include "broker/errors.h"
#include "shm/seqlock.h"
#include "spindle/slots.h"

namespace spindle {

namespace errtext {
inline constexpr std::string_view kSlotGeometryInvalid =
    "slot buffer geometry invalid: slot count and slot size must be > 0 and the buffer must fit in memory";
inline constexpr std::string_view kSlotFdTooSmall = "fd is too small to hold a slot buffer header";
inline constexpr std::string_view kSlotFdNotSealed =
    "fd is not a memfd sealed against shrinking and growing (expected one from SlotBuffer::create)";
inline constexpr std::string_view kSlotBadMagic = "fd does not hold a slot buffer (bad magic)";
inline constexpr std::string_view kSlotBadVersion = "slot buffer format version mismatch";
inline constexpr std::string_view kSlotBadGeometry = "slot buffer header geometry is inconsistent";
inline constexpr std::string_view kSlotSizeMismatch = "slot buffer header size does not match the fd's size";
inline constexpr std::string_view kSlotLayoutMismatch = "slot buffer holds records of another layout";
inline constexpr std::string_view kSlotIndexOutOfRange = "slot index out of range";
inline constexpr std::string_view kSlotDataTooLarge = "data larger than the slot";
inline constexpr std::string_view kSlotUnalignedStore = "slot store offset must be a multiple of 8";
}  // namespace errtext

// A buffer that cannot be created or attached. what() starts with one of the
// errtext::kSlot* texts, followed by the details.
class SlotBufferError : public Error {
 public:
  using Error::Error;
};

namespace shm {

// The public statuses (<spindle/slots.h>), one enum for both layers.
using ::spindle::SlotStatus;

struct SlotGeometry {
  std::size_t slot_count = 0;
  std::size_t slot_size = 0;     // payload bytes per slot
  std::uint64_t layout_tag = 0;  // what the slots hold; checked by RecordSlots
};

using ReadResult = ::spindle::SlotBuffer::ReadResult;  // the public results too
using PushResult = ::spindle::SlotBuffer::PushResult;

// The header at offset 0 of the mapping. Public for tests that corrupt it.
struct SlotBufferHeader {
  static constexpr std::uint64_t kMagic = 0x544f4c5344505300ull;  // "\0SPDSLOT"
  static constexpr std::uint32_t kVersion = 1;
  static constexpr std::uint32_t kSize = 4096;  // slots start page-aligned
  std::uint64_t magic;
  std::uint32_t version;
  std::uint32_t header_size;
  std::uint64_t slot_count;
  std::uint64_t slot_size;
  std::uint64_t slot_stride;
  std::uint64_t total_size;
  std::uint64_t layout_tag;
  std::uint64_t next_push;  // atomic: push() tickets handed out
};

class SlotBuffer;

// A writer inside one slot (held lock). store() copies bytes in; commit()
// publishes; destroying it uncommitted releases the slot as kEmpty, so a
// half-written slot is never shown to readers. Move-only.
class SlotWriter {
 public:
  SlotWriter(SlotWriter&& other) noexcept;
  SlotWriter& operator=(SlotWriter&&) = delete;
  ~SlotWriter();

  // kOk when the slot is held; kBusy when a live writer kept it past the bound.
  SlotStatus status() const { return slot_ ? SlotStatus::kOk : SlotStatus::kBusy; }
  bool held() const { return slot_ != nullptr; }
  void store(std::size_t offset, std::span<const std::byte> bytes);
  void commit(std::size_t length);

 private:
  friend class SlotBuffer;
  SlotWriter(std::uint64_t* slot, std::uint32_t odd_seq, std::size_t capacity)
      : slot_(slot), odd_seq_(odd_seq), capacity_(capacity) {}
  void release(std::uint64_t meta);

  std::uint64_t* slot_;  // null when not held
  std::uint32_t odd_seq_;
  std::size_t capacity_;
};

class SlotBuffer {
 public:
  // Creates the memfd, sizes and seals it, writes the header. Throws
  // SlotBufferError (bad geometry) or std::system_error (a syscall failed).
  static std::unique_ptr<SlotBuffer> create(const SlotGeometry& geometry);
  // Maps a buffer from an fd another process created. Takes ownership of fd
  // (closed on failure too). Throws SlotBufferError naming what is wrong.
  static std::unique_ptr<SlotBuffer> attach(int fd);

  ~SlotBuffer();
  SlotBuffer(const SlotBuffer&) = delete;
  SlotBuffer& operator=(const SlotBuffer&) = delete;

  int fd() const { return fd_; }  // to hand to another process; still ours
  std::size_t slot_count() const { return slot_count_; }
  std::size_t slot_size() const { return slot_size_; }
  std::uint64_t layout_tag() const { return layout_tag_; }
  std::size_t mapped_bytes() const { return map_size_; }
  void set_wait_bound(const seqlock::WaitBound& bound) { bound_ = bound; }

  // Writes data.size() bytes (<= slot_size(), else std::length_error) to the
  // slot: kOk, or kBusy if a live writer kept it past the wait bound.
  SlotStatus write(std::size_t slot, std::span<const std::byte> data);
  // Takes the slot for a piecewise write (or reclaims it from a dead writer).
  SlotWriter lock_slot(std::size_t slot);
  // Writes to the next slot in ring order (ticket % slot_count).
  PushResult push(std::span<const std::byte> data);
  // Slots that push() has handed out, capped at slot_count(): samplers draw
  // from [0, filled()).
  std::size_t filled() const;

  // Copies the slot's bytes into out if out is large enough (else kTooSmall).
  ReadResult read(std::size_t slot, std::span<std::byte> out) const;

 private:
  SlotBuffer(int fd, void* map, std::size_t map_size, const SlotBufferHeader& geometry);
  std::uint64_t* slot_words(std::size_t slot) const;
  SlotBufferHeader& header() const { return *static_cast<SlotBufferHeader*>(map_); }

  int fd_;
  void* map_;
  std::size_t map_size_;
  std::size_t slot_count_;
  std::size_t slot_size_;
  std::size_t slot_stride_;
  std::uint64_t layout_tag_;
  seqlock::WaitBound bound_;
};

}  // namespace shm
}  // namespace spindle
