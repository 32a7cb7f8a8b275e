// Memfd payloads: large message bodies that travel as a sealed memfd instead
// of through the socket.
//
// SealedMemfd is an anonymous memfd (memfd_create: no name in /dev/shm, so
// nothing to collide with and nothing left behind after a crash) whose size
// and contents can no longer change: sealed F_SEAL_SHRINK | F_SEAL_GROW |
// F_SEAL_WRITE before it leaves the process. A receiver adopts an fd only
// after checking those seals, then maps it read-only; the Payload it hands to
// the handler is a view of the mapping (its owner), never a copy.
//
// PayloadBuffer is the zero-copy way in: a writable mapping of a fresh memfd
// that the sender fills in place; seal() drops the writable mapping, seals the
// memfd and returns it as a Payload, so a large message is never copied.
//
// Thread safety: a SealedMemfd is immutable and may be shared between
// threads. A PayloadBuffer belongs to one thread until sealed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "spindle/fds.h"
#include "stream/account.h"
#include "stream/payload.h"

namespace spindle {

// The default size from which a payload travels as a memfd (RouterOptions).
inline constexpr std::size_t kDefaultMemfdThreshold = 1u << 20;
// What a memfd must carry before it may leave the process or be accepted.
inline constexpr int kRequiredSeals = 0x0002 | 0x0004 | 0x0008;  // SHRINK | GROW | WRITE

namespace errtext {
// A fresh copy into a memfd could not be sealed: the kernel (reclaim, page
// migration) held one of its pages through every try.
inline constexpr std::string_view kMemfdPagesHeld =
    "the kernel still holds pages of a fresh memfd (reclaim or migration): it cannot be sealed against "
    "writing";
}  // namespace errtext

class SealedMemfd : public std::enable_shared_from_this<SealedMemfd> {
 public:
  // A new sealed memfd holding a copy of `bytes` (one pwritev, no mapping).
  // Throws std::system_error, also when the kernel holds a page of it at
  // the one try to seal it (errtext::kMemfdPagesHeld; the router then sends
  // the bytes inline).
  static std::shared_ptr<const SealedMemfd> copy_of(const Payload& bytes);
  // Checks a received fd: a memfd whose size is sealed and whose contents are
  // write-sealed. Returns nullptr and sets `error` if it is not. Its size is
  // charged to `account` (if any) for as long as it lives: a peer's memfd
  // body costs it its mapped size, whether or not it is ever mapped. With
  // kWithinLimits, a body that does not fit the account's allowance is
  // refused the same way (an untrusted peer; see StreamOptions::untrusted).
  // `fd_charge` (the FdBudget charge of the batch the fd came in) is held
  // as long as the memfd is: whatever keeps the body (a reply that echoes
  // it, a view of it) keeps its fd open, and so keeps it charged.
  static std::shared_ptr<const SealedMemfd> adopt(UniqueFd fd, std::string& error,
                                                   std::shared_ptr<Account> account = nullptr,
                                                   PeerCharge how = PeerCharge::kAlways,
                                                   std::shared_ptr<void> fd_charge = nullptr);

  int fd() const { return fd_.get(); }
  std::size_t size() const { return size_; }
  // A read-only view of the whole contents; the Payload's owner is the
  // mapping, which keeps this memfd alive, and payload.memfd() names it, so
  // sending the payload on passes the fd again. Never populated: whoever
  // reads the bytes faults them in, on its own thread, and a view that is
  // only sent on (the fd travels) or read in part costs no page tables.
  // Throws std::system_error.
  Payload map() const;

  // `around` with `length` bytes of this memfd, from `offset`, put in at
  // byte `at`: a view of a mapping of the memfd (not populated, never a
  // copy) between the bytes of `around`, and memfd_span() names it. The
  // caller has checked the range. `kept` (the charge for the bytes around,
  // copied into the view's own pages) lives as long as the view. Throws
  // std::system_error.
  Payload map_into(const Payload& around, std::size_t at, std::size_t offset, std::size_t length,
                   Charge kept = {}) const;

  // Bytes of a memfd among the `n` bytes at `p`, found by address in the
  // live mappings (map(), map_into()): bytes received in a memfd and put
  // into a payload of the caller's own (a reply that wraps them, or all of
  // a received body with what came around it) can travel as a range of that
  // memfd. Either the `n` bytes all lie in one mapping, or a received range
  // lies within them; `skip` bytes of them come first, then `length` bytes
  // of `memfd` from `offset`. nullopt when neither.
  struct Found {
    std::shared_ptr<const SealedMemfd> memfd;
    std::size_t offset = 0, skip = 0, length = 0;
  };
  static std::optional<Found> mapped_at(const std::uint8_t* p, std::size_t n);

  SealedMemfd(UniqueFd fd, std::size_t size) : fd_(std::move(fd)), size_(size) {}

 private:
  UniqueFd fd_;
  std::size_t size_;
  Charge charge_;
  std::shared_ptr<void> fd_charge_;
};

// `bytes` (a payload of at least the memfd threshold) ready to travel as a
// memfd. When all but its largest slice is smaller than `inline_max`, that
// slice becomes the memfd range and the rest goes inline: a slice that lies
// in a live mapping of a sealed memfd (bytes received, wrapped in a reply)
// and is at least half of that memfd is sent as its range, with no copy;
// any other is copied alone into a fresh memfd. (Below half, a copy: a
// small slice would otherwise hold a large memfd in the receiver.) Past
// `inline_max`, the whole payload is copied into a fresh memfd. Throws
// std::system_error.
Payload memfd_ready(const Payload& bytes, std::size_t inline_max);

class PayloadBuffer {
 public:
  // A fresh memfd of `size` bytes, mapped writable. Throws std::system_error.
  explicit PayloadBuffer(std::size_t size);
  ~PayloadBuffer();
  PayloadBuffer(PayloadBuffer&& o) noexcept;
  PayloadBuffer& operator=(PayloadBuffer&&) = delete;
  PayloadBuffer(const PayloadBuffer&) = delete;

  std::span<std::uint8_t> bytes() { return {addr_, size_}; }
  std::size_t size() const { return size_; }

  // What seal() does with the writable view.
  enum class View {
    kUnmap,        // it is gone, and the buffer is empty afterwards
    kKeepPrivate,  // it stays, at the same address, as a private
                   // copy-on-write mapping of the sealed bytes: pointers
                   // into it (a Python memoryview) stay valid, and later
                   // writes stay in this process, never in the message
  };
  // Seals the memfd and returns it as a Payload (a read-only view). Where
  // the memfd cannot be sealed (a process forked since still maps it
  // writable, or the kernel holds one of its pages), the Payload is a
  // sealed copy of its bytes instead. Throws std::system_error.
  Payload seal(View view = View::kUnmap) &&;

 private:
  UniqueFd fd_;
  std::uint8_t* addr_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace spindle
