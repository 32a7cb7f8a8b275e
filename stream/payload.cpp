#include "stream/payload.h"

#include <cstring>
#include <utility>

#include "stream/memfd.h"

namespace spindle {

Payload Payload::copy_of(std::span<const std::uint8_t> bytes) {
  if (bytes.empty()) return {};
  // One allocation holds the reference count and the bytes.
  std::shared_ptr<std::uint8_t[]> buf = std::make_shared_for_overwrite<std::uint8_t[]>(bytes.size());
  std::memcpy(buf.get(), bytes.data(), bytes.size());
  Payload p;
  const std::uint8_t* data = buf.get();
  p.append(Slice{std::move(buf), data, bytes.size()});
  return p;
}

Payload Payload::copy_of(std::string_view bytes) {
  return copy_of(std::span<const std::uint8_t>(
      reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size()));
}

Payload Payload::adopt(std::shared_ptr<const Chunk> chunk, std::size_t size) {
  Payload p;
  const std::uint8_t* data = chunk->data();
  p.append(Slice{std::move(chunk), data, size});
  return p;
}

void Payload::set_memfd_span(MemfdSpan s) {
  if (!s.memfd) return span_.reset();
  s.whole = s.at == 0 && s.offset == 0 && s.length == size_ && s.length == s.memfd->size();
  span_ = std::make_shared<const MemfdSpan>(std::move(s));
}

void Payload::append(Slice s) {
  if (s.size == 0) return;
  size_ += s.size;
  if (count_ < kInline) {
    inline_[count_++] = std::move(s);
    return;
  }
  if (count_ == kInline) {  // spill: from now on every slice lives in spill_
    spill_.reserve(2 * kInline);
    for (auto& i : inline_) spill_.push_back(std::exchange(i, Slice{}));
  }
  spill_.push_back(std::move(s));
  ++count_;
}

Payload Payload::owned_copy() const {
  if (size_ == 0) return {};
  std::shared_ptr<std::uint8_t[]> buf = std::make_shared_for_overwrite<std::uint8_t[]>(size_);
  copy_to(buf.get());
  Payload p;
  const std::uint8_t* data = buf.get();
  p.append(Slice{std::move(buf), data, size_});
  return p;
}

std::string Payload::to_string() const {
  std::string out(size_, '\0');
  copy_to(reinterpret_cast<std::uint8_t*>(out.data()));
  return out;
}

void Payload::copy_to(std::uint8_t* out) const {
  for (const Slice& s : slices()) {
    std::memcpy(out, s.data, s.size);
    out += s.size;
  }
}

std::span<const std::uint8_t> Payload::contiguous() const {
  if (count_ != 1) return {};
  return {inline_[0].data, inline_[0].size};
}

}  // namespace spindle
