// Slots: fixed-size slots in shared memory that several processes write and
// sample concurrently (a replay buffer), handed between them as an fd.
//
//   struct Transition { static constexpr std::uint32_t kLayoutId = 1; ... };  // trivially copyable
//
//   auto slots = spindle::RecordSlots<Transition>::create(4096);      // parent
//   child.call(attach, spindle::dup_fd(slots.buffer().fd()));          // an fd argument
//
//   env.expose(attach, [&](spindle::UniqueFd fd) {                     // child
//     auto slots = spindle::RecordSlots<Transition>::attach(std::move(fd));
//     slots.push(t);  ...  slots.read(i, t) == spindle::SlotStatus::kOk
//   });
//
// Role: one sealed memfd (no name in /dev/shm; sealed against shrinking and
// growing, so no process can truncate it under the others and make them
// fault) holds a header and N slots, each with its own seqlock word: no fd
// or kernel object per slot, whatever the count. Readers never see a torn
// slot: read() gives a consistent copy, or a status after a bounded wait. A
// writer that died inside a slot leaves it kAbandoned until the next write
// reclaims it (docs/DESIGN.md, Shared slot buffer).
//
// SlotBuffer holds bytes; RecordSlots<Record> holds one fixed-layout record
// per slot and checks, at compile time, that the record can live in shared
// memory and, at attach, that the buffer was made for this layout (its tag is
// Record::kLayoutId with sizeof(Record)): a process built with an older
// struct gets an Error, not garbage.
//
// Thread safety: every method from any thread of any process that maps the
// buffer. Ownership: a SlotBuffer owns its mapping and its fd (fd() lends
// it: pass spindle::dup_fd(fd()) to send it); a RecordSlots owns its
// SlotBuffer. Errors: spindle::Error naming what is wrong (geometry, not a
// sealed memfd, bad header, another layout), std::system_error for a failed
// syscall.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include <spindle/errors.h>
#include <spindle/fds.h>

namespace spindle {
namespace shm {
class SlotBuffer;
}

enum class SlotStatus {
  kOk,         // read: a consistent copy; write: published
  kEmpty,      // read: never written (or a writer gave up without committing)
  kBusy,       // a live writer held the slot for longer than the wait bound
  kAbandoned,  // read: the slot's writer died inside it; a write reclaims it
  kTooSmall,   // read: the caller's buffer is shorter than the stored length
};
std::string_view to_string(SlotStatus s);

class SlotBuffer {
 public:
  struct ReadResult {
    SlotStatus status;
    std::size_t length;  // bytes stored in the slot (kOk, kTooSmall)
  };
  struct PushResult {
    SlotStatus status;
    std::size_t slot;
  };

  // A new buffer of slot_count slots of slot_size bytes; layout_tag says
  // what they hold (checked by whoever attaches).
  static SlotBuffer create(std::size_t slot_count, std::size_t slot_size, std::uint64_t layout_tag = 0);
  // Maps the buffer another process created, from its fd (closed on failure).
  static SlotBuffer attach(UniqueFd fd);

  SlotBuffer(SlotBuffer&&) noexcept;
  SlotBuffer& operator=(SlotBuffer&&) noexcept;
  ~SlotBuffer();

  int fd() const;  // lent: dup_fd(fd()) to pass it on
  std::size_t slot_count() const;
  std::size_t slot_size() const;
  std::uint64_t layout_tag() const;

  // Writes data (at most slot_size() bytes, else std::length_error) to the
  // slot: kOk, or kBusy if a live writer kept it past the wait bound.
  SlotStatus write(std::size_t slot, std::span<const std::byte> data);
  // Writes to the next slot in ring order.
  PushResult push(std::span<const std::byte> data);
  // Slots push() has handed out, at most slot_count(): sample from [0, filled()).
  std::size_t filled() const;
  // Copies the slot's bytes into `out` if they fit (else kTooSmall).
  ReadResult read(std::size_t slot, std::span<std::byte> out) const;

 private:
  explicit SlotBuffer(std::unique_ptr<shm::SlotBuffer> impl);
  std::unique_ptr<shm::SlotBuffer> impl_;
};

template <class Record>
class RecordSlots {
  static_assert(std::is_trivially_copyable_v<Record>,
                "a slot record is copied as bytes between processes: it must be trivially copyable");
  static_assert(std::is_standard_layout_v<Record>,
                "a slot record must have one fixed layout in every process: make it standard-layout");
  static_assert(std::is_same_v<std::remove_cv_t<decltype(Record::kLayoutId)>, std::uint32_t>,
                "a slot record declares `static constexpr std::uint32_t kLayoutId`");

 public:
  static constexpr std::uint64_t kLayoutTag = (std::uint64_t{Record::kLayoutId} << 32) | sizeof(Record);

  static RecordSlots create(std::size_t slot_count) {
    return RecordSlots(SlotBuffer::create(slot_count, sizeof(Record), kLayoutTag));
  }
  static RecordSlots attach(UniqueFd fd) { return RecordSlots(SlotBuffer::attach(std::move(fd))); }
  // Throws Error unless `buffer` was made for this record layout.
  explicit RecordSlots(SlotBuffer buffer) : buffer_(std::move(buffer)) {
    if (buffer_.layout_tag() != kLayoutTag || buffer_.slot_size() != sizeof(Record))
      throw Error("slot buffer holds records of another layout: buffer tag " +
                  std::to_string(buffer_.layout_tag()) + " slot size " + std::to_string(buffer_.slot_size()) +
                  ", record tag " + std::to_string(kLayoutTag) + " size " + std::to_string(sizeof(Record)));
  }

  SlotBuffer& buffer() { return buffer_; }
  const SlotBuffer& buffer() const { return buffer_; }
  std::size_t slot_count() const { return buffer_.slot_count(); }
  std::size_t filled() const { return buffer_.filled(); }

  SlotStatus write(std::size_t slot, const Record& r) { return buffer_.write(slot, bytes_of(r)); }
  SlotBuffer::PushResult push(const Record& r) { return buffer_.push(bytes_of(r)); }
  // kOk only with a whole record; a slot holding fewer bytes reads as kEmpty.
  SlotStatus read(std::size_t slot, Record& out) const {
    auto r = buffer_.read(slot, std::as_writable_bytes(std::span<Record, 1>(&out, 1)));
    if (r.status == SlotStatus::kOk && r.length != sizeof(Record)) return SlotStatus::kEmpty;
    return r.status;
  }

 private:
  static std::span<const std::byte> bytes_of(const Record& r) {
    return std::as_bytes(std::span<const Record, 1>(&r, 1));
  }

  SlotBuffer buffer_;
};

}  // namespace spindle
