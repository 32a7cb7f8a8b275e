// TxQueue: the frames waiting to be written on one stream.
//
// Design: small frames are copied whole, header and body, into a byte log of
// 32 KiB blocks taken from a per-thread pool, so a burst of tiny frames is a
// handful of contiguous spans and one gathered write moves hundreds of them.
// A frame whose body is large, carries fds, or streams from a memfd is queued
// as a TxFrame entry instead: its header is copied, its body is sent from
// where it lies (never copied), and its position in the byte log keeps it in
// order with the frames around it. Nothing here allocates in steady state:
// blocks return to the pool, and the entry ring keeps its capacity.
//
// Accounting: everything the queue holds is charged to the peer's Account
// (the memory a peer that does not read makes us hold): each block, and each
// entry at the bytes it keeps alive (its body, or the window mapped of a
// streamed memfd), whoever made it. A reply the router writes for the peer is
// never refused at the gauge (the peer asked for it), so this charge is what
// stops reading a peer that asks for large answers and never reads them: its
// account goes over, reading it pauses, and the stall rule ends it. (Its
// calls still in flight are pledged to the same account meanwhile:
// Router::kCallInFlightBytes.) The queue also counts the bytes queued for
// the stream's high-water mark: inline bytes one for one, entries at the
// charge their producer gave them.
//
// Thread safety: broker thread only. Ownership: owned by one Stream; borrows
// the Account, which the stream keeps alive.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <boost/container/small_vector.hpp>

#include "broker/ring.h"
#include "spindle/fds.h"
#include "spindle/frame.h"
#include "spindle/message.h"
#include "stream/account.h"
#include "stream/fd_frame.h"
#include "stream/payload.h"

struct iovec;

namespace spindle {

inline constexpr std::size_t kTxBlockSize = 32 * 1024;
// Bodies up to this size are copied into the byte log; larger ones are sent
// from where they lie.
inline constexpr std::size_t kInlineBodyMax = 8 * 1024;
// A memfd body streamed to a peer that cannot take fds is mapped this much
// at a time: the broker never faults in more than one window per write.
inline constexpr std::size_t kStreamWindow = 1u << 20;

class SealedMemfd;

// A frame queued by reference.
struct TxFrame {
  HeaderBytes header{};
  bool has_header = true;  // false for raw handshake bytes
  Payload body;
  // A body read from this memfd in windows (a peer without fd passing): its
  // `streamed_len` bytes from `streamed_at`, put in after the first
  // `streamed_split` bytes of `body` (the bytes around a memfd range; for a
  // memfd body, `body` is empty and the range is the whole memfd).
  std::shared_ptr<const SealedMemfd> streamed;
  std::size_t streamed_at = 0, streamed_len = 0, streamed_split = 0;
  std::size_t charged = 0;  // high-water-mark bytes, released once written
  std::size_t skip = 0;     // bytes of it already written (by an application thread)
  // SF frames: the prefix (sent between header and body, and marked as a
  // batch head when the write that carries it carries the fds of several
  // frames), the fds to pass with the first byte, held open until sent, and
  // the message as it was queued (so its sender can be told of a refusal).
  std::array<std::uint8_t, kFdPrefixSize> prefix{};
  bool prefixed = false;
  boost::container::small_vector<int, 4> wire_fds;
  FdSet fds_hold;
  std::shared_ptr<const SealedMemfd> body_hold;
  bool fds_sent = false;
  std::unique_ptr<Message> original;

  std::size_t body_size() const;
  std::size_t size() const { return (has_header ? kHeaderSize : 0) + body_size(); }
  bool needs_fds_now() const { return !wire_fds.empty() && !fds_sent; }
};

// What a closed queue held that never reached the peer whole.
struct Unsent {
  static constexpr std::size_t kOtherKept = 1024;
  std::vector<Header> wanting_reply;  // senders to tell (reply_to set, not dead)
  std::vector<std::unique_ptr<Message>> originals;  // SF frames, fds included
  std::vector<Header> other_headers;  // no reply_to: the first kOtherKept, for the record
  std::size_t dead = 0;               // dead replies: dropped
  std::size_t other = 0;              // messages that asked for no reply
};

class TxQueue {
 public:
  explicit TxQueue(Account* account = nullptr) : account_(account) {}
  ~TxQueue();
  TxQueue(const TxQueue&) = delete;
  TxQueue& operator=(const TxQueue&) = delete;

  // Copies a whole frame into the byte log: header, then the body's slices.
  void append_inline(const HeaderBytes& header, const Payload& body);
  void append_inline(const HeaderBytes& header, const std::uint8_t* body, std::size_t n);
  // A whole frame whose `body_len` body bytes the caller pushes through
  // body(push), push(const std::uint8_t*, std::size_t) (e.g. spans of a
  // frame still in a receive buffer).
  template <class F>
  void append_inline_with(const HeaderBytes& header, std::size_t body_len, F&& body) {
    note_frame_start();
    push_bytes(header.data(), kHeaderSize);
    body([this](const std::uint8_t* p, std::size_t n) { push_bytes(p, n); });
    queued_ += kHeaderSize + body_len;
  }
  // Raw bytes (a handshake greeting): inline, no header of ours.
  void append_raw(const std::uint8_t* p, std::size_t n);
  void append_frame(TxFrame&& f);
  // Before everything queued: the rest of a frame an application thread
  // began writing while the broker could only queue behind it.
  void push_front_frame(TxFrame&& f);

  bool empty() const { return head_ == tail_ && frames_.empty(); }
  // Bytes still to be written (the high-water mark's view).
  std::size_t queued_bytes() const { return queued_; }
  std::size_t blocks() const { return blocks_.size(); }
  // Free blocks the calling thread keeps for reuse (none but on a broker's
  // own thread).
  static std::size_t cached_blocks();
  std::size_t frames_queued() const { return frames_.size(); }
  // Frames written whole so far (those the queue dropped unsent at clear()
  // not among them). Counts the last block's frames, so it is for stats.
  std::uint64_t frames_written();

  struct Gather {
    int iovcnt = 0;
    std::size_t bytes = 0;
    // The SF frames whose fds go with this write (the first of them is its
    // first byte), and how many fds that is.
    boost::container::small_vector<TxFrame*, 8> fd_frames;
    std::size_t fds = 0;
    std::string error;  // a streamed memfd could not be mapped
  };
  // Builds iovecs for the next write from the head. A frame with fds starts
  // a write of its own. With `fd_batches` (the peer binds fds by count) the
  // SF frames after it join that write, their fds with its own, up to 253
  // fds, and the first is marked as the batch head; without, no write holds
  // two of them.
  Gather gather(iovec* iov, int max, bool fd_batches = false);
  // Consumes `n` written bytes; returns the high-water-mark bytes released.
  std::size_t advance(std::size_t n);
  // The frame at the head, if the next byte belongs to a TxFrame entry.
  TxFrame* head_frame();
  // Removes the head TxFrame entry, which must not have been started.
  TxFrame pop_head_frame();
  // Empties the queue; reports what never reached the peer whole.
  Unsent clear();

 private:
  struct Entry {
    std::uint64_t at = 0;  // inline bytes queued before this frame
    std::uint64_t inline_before = 0;  // inline frames queued before it
    TxFrame frame;
    std::size_t sent = 0;
    std::size_t held = 0;  // charged to the account while queued (held_bytes)
    std::size_t window_at = 0, window_len = 0;  // mapped window (streamed)
    void* window = nullptr;
  };
  // Where the first inline frame that starts in a block starts, and how
  // many inline frames came before it (sync_boundary()).
  struct BlockStart {
    static constexpr std::uint64_t kNone = ~std::uint64_t{0};
    std::uint64_t at = kNone;
    std::uint64_t index = 0;
  };
  std::uint8_t* block_at(std::uint64_t pos);
  Header header_at(std::uint64_t pos);
  std::uint64_t inline_index_at(std::uint64_t pos);
  void add_block();
  void note_frame_start();
  void push_bytes(const std::uint8_t* p, std::size_t n);
  void free_blocks_before(std::uint64_t pos);
  void sync_boundary();
  bool map_window(Entry& e, std::size_t off, std::string& error);
  static void unmap_window(Entry& e);
  static std::size_t held_bytes(const TxFrame& f);
  void charge_entry(Entry& e);
  void pop_front_entry();

  Account* account_;
  Ring<std::uint8_t*> blocks_;         // blocks_[0] holds position base_
  Ring<BlockStart> starts_;            // one per block, alike
  std::uint64_t base_ = 0;             // position of blocks_[0][0]
  std::uint64_t head_ = 0, tail_ = 0;  // inline bytes written / appended
  std::uint64_t boundary_ = 0;         // a frame boundary <= head_ (never inside a frame)
  std::uint64_t boundary_index_ = 0;   // inline frames queued before boundary_
  std::uint64_t inline_frames_ = 0;    // inline frames queued so far
  Ring<Entry> frames_;
  std::size_t queued_ = 0;
  std::uint64_t entry_frames_written_ = 0;  // TxFrame entries written whole
  std::uint64_t unsent_inline_ = 0;         // inline frames clear() dropped unsent
};

}  // namespace spindle
