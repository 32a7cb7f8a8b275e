// The public SlotBuffer is a pimpl over shm::SlotBuffer (shm/slot_buffer.h),
// which uses the public SlotStatus; the internal class stays for the tests
// and benches that corrupt headers and tune wait bounds.
#include "spindle/slots.h"

#include "shm/slot_buffer.h"

namespace spindle {
std::string_view to_string(SlotStatus s) {
  switch (s) {
    case SlotStatus::kOk: return "ok";
    case SlotStatus::kEmpty: return "empty";
    case SlotStatus::kBusy: return "busy";
    case SlotStatus::kAbandoned: return "abandoned";
    case SlotStatus::kTooSmall: return "too small";
  }
  return "?";
}

SlotBuffer::SlotBuffer(std::unique_ptr<shm::SlotBuffer> impl) : impl_(std::move(impl)) {}
SlotBuffer::SlotBuffer(SlotBuffer&&) noexcept = default;
SlotBuffer& SlotBuffer::operator=(SlotBuffer&&) noexcept = default;
SlotBuffer::~SlotBuffer() = default;

SlotBuffer SlotBuffer::create(std::size_t slot_count, std::size_t slot_size, std::uint64_t layout_tag) {
  return SlotBuffer(shm::SlotBuffer::create({slot_count, slot_size, layout_tag}));
}

SlotBuffer SlotBuffer::attach(UniqueFd fd) {
  if (!fd) throw Error("SlotBuffer::attach: no fd (an empty UniqueFd)");
  return SlotBuffer(shm::SlotBuffer::attach(fd.release()));  // attach() owns it, failing too
}

int SlotBuffer::fd() const { return impl_->fd(); }
std::size_t SlotBuffer::slot_count() const { return impl_->slot_count(); }
std::size_t SlotBuffer::slot_size() const { return impl_->slot_size(); }
std::uint64_t SlotBuffer::layout_tag() const { return impl_->layout_tag(); }
std::size_t SlotBuffer::filled() const { return impl_->filled(); }

SlotStatus SlotBuffer::write(std::size_t slot, std::span<const std::byte> data) {
  return impl_->write(slot, data);
}

SlotBuffer::PushResult SlotBuffer::push(std::span<const std::byte> data) {
  return impl_->push(data);
}

SlotBuffer::ReadResult SlotBuffer::read(std::size_t slot, std::span<std::byte> out) const {
  return impl_->read(slot, out);
}

}  // namespace spindle
