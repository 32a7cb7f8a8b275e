// RecordSlots<Record>: typed access to a SlotBuffer whose slots each hold one
// fixed-layout record (a struct of ints and arrays, e.g. a transition).
//
// Role: checks at compile time that Record can live in shared memory (it is
// trivially copyable and standard-layout, so copying its bytes is copying the
// record), and at attach time that the buffer was created for this record
// layout: the buffer's layout tag is Record::kLayoutId (a number the record's
// author bumps when the fields change) combined with sizeof(Record). A
// process built with an older struct gets SlotBufferError, not garbage.
//
// Thread safety: as SlotBuffer (any thread, any process). Ownership: borrows
// the SlotBuffer, which must outlive it.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <type_traits>

#include <fmt/format.h>

#include "shm/slot_buffer.h"

namespace spindle::shm {

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

  static std::unique_ptr<SlotBuffer> create(std::size_t slot_count) {
    return SlotBuffer::create({slot_count, sizeof(Record), kLayoutTag});
  }

  explicit RecordSlots(SlotBuffer& buffer) : buffer_(buffer) {
    if (buffer.layout_tag() != kLayoutTag || buffer.slot_size() != sizeof(Record))
      throw SlotBufferError(fmt::format("{}: buffer tag {:#x} slot size {}, record tag {:#x} size {}",
                                        errtext::kSlotLayoutMismatch, buffer.layout_tag(), buffer.slot_size(),
                                        kLayoutTag, sizeof(Record)));
  }

  SlotBuffer& buffer() const { return buffer_; }
  std::size_t slot_count() const { return buffer_.slot_count(); }
  std::size_t filled() const { return buffer_.filled(); }

  SlotStatus write(std::size_t slot, const Record& r) { return buffer_.write(slot, bytes_of(r)); }
  PushResult push(const Record& r) { return buffer_.push(bytes_of(r)); }
  // kOk only with a whole record; a slot holding fewer bytes reads as kEmpty.
  SlotStatus read(std::size_t slot, Record& out) const {
    ReadResult r = buffer_.read(slot, std::as_writable_bytes(std::span<Record, 1>(&out, 1)));
    if (r.status == SlotStatus::kOk && r.length != sizeof(Record)) return SlotStatus::kEmpty;
    return r.status;
  }

 private:
  static std::span<const std::byte> bytes_of(const Record& r) {
    return std::as_bytes(std::span<const Record, 1>(&r, 1));
  }

  SlotBuffer& buffer_;
};

}  // namespace spindle::shm
