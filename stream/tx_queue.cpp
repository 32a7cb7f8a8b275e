// Positions are absolute byte counts of the inline log (head_ written, tail_
// appended); block k of blocks_ holds [base_ + k*kTxBlockSize, ...). A TxFrame
// entry sits at an inline position: everything inline before it goes first.
//
// Blocks are freed only behind boundary_, a frame's start at or before the
// oldest frame not yet written whole, so that when a stream closes, a frame
// the peer received only in part can still be decoded and its sender told
// it was not delivered. boundary_ moves without reading the frames it passes:
// each block records the first inline frame that starts in it (and how many
// inline frames came before), and a write moves boundary_ to the last such
// start it has passed, or to head_ when that ends the inline bytes before
// the next entry or the tail. Reading every header written back out of the
// log after each write (to step over frames one by one) was a fifth of the
// broker thread's time in a stream of 64 B frames (bench_core oneway,
// perf). The frames between boundary_ and head_, at most two blocks',
// are counted only when asked (frames_written(), clear()).

#include "stream/tx_queue.h"

#include <sys/mman.h>
#include <sys/uio.h>

#include <algorithm>
#include <cassert>
#include <cstring>

#include <fmt/format.h>

#include "broker/broker.h"
#include "broker/errors.h"
#include "spindle/options.h"
#include "stream/memfd.h"

namespace spindle {
namespace {

// Free blocks of this thread, reused before new ones are allocated. It keeps
// as many as one stream's queue holds at the default high-water mark (8 MiB,
// and the block its last frame straddles), so a queue that fills to its mark
// and drains, again and again (a receiver that reads in bursts), allocates
// nothing after the first time (with 64 kept, 2 MiB, each refill allocated
// up to 193 blocks again). The price: a thread that once queued 8 MiB keeps
// it, as malloc would keep most of it in its arena anyway.
// Only a broker's own thread keeps any: an application thread that ran the
// loop for a while (broker.h, leader/follower) frees its blocks, so a process
// with many calling threads does not hold blocks in each of them.
class BlockPool {
 public:
  ~BlockPool() {
    for (auto* b : free_) delete[] b;
  }
  std::uint8_t* get() {
    if (free_.empty()) return new std::uint8_t[kTxBlockSize];
    std::uint8_t* b = free_.back();
    free_.pop_back();
    return b;
  }
  void put(std::uint8_t* b) {
    if (free_.size() < kMaxCached && Broker::on_an_own_thread()) free_.push_back(b);
    else delete[] b;
  }
  std::size_t size() const { return free_.size(); }

 private:
  static constexpr std::size_t kMaxCached = kDefaultHighWaterMark / kTxBlockSize + 1;
  std::vector<std::uint8_t*> free_;
};

BlockPool& pool() {
  static thread_local BlockPool p;
  return p;
}

}  // namespace

std::size_t TxFrame::body_size() const {
  return (prefixed ? kFdPrefixSize : 0) + body.size() + (streamed ? streamed_len : 0);
}

TxQueue::~TxQueue() { clear(); }

std::size_t TxQueue::cached_blocks() { return pool().size(); }

std::uint8_t* TxQueue::block_at(std::uint64_t pos) {
  std::size_t k = static_cast<std::size_t>((pos - base_) / kTxBlockSize);
  return blocks_[k] + (pos - base_) % kTxBlockSize;
}

void TxQueue::add_block() {
  blocks_.push_back(pool().get());
  starts_.push_back(BlockStart{});
  if (account_) account_->charge(kTxBlockSize);
}

void TxQueue::note_frame_start() {
  if (tail_ - base_ == blocks_.size() * kTxBlockSize) add_block();
  BlockStart& b = starts_[static_cast<std::size_t>((tail_ - base_) / kTxBlockSize)];
  if (b.at == BlockStart::kNone) b = BlockStart{tail_, inline_frames_};
  ++inline_frames_;
}

void TxQueue::push_bytes(const std::uint8_t* p, std::size_t n) {
  while (n > 0) {
    std::size_t in_block = static_cast<std::size_t>((tail_ - base_) % kTxBlockSize);
    if (tail_ - base_ == blocks_.size() * kTxBlockSize) {
      add_block();
      in_block = 0;
    }
    std::size_t len = std::min(n, kTxBlockSize - in_block);
    std::memcpy(block_at(tail_), p, len);
    tail_ += len;
    p += len;
    n -= len;
  }
}

void TxQueue::append_inline(const HeaderBytes& header, const std::uint8_t* body, std::size_t n) {
  note_frame_start();
  push_bytes(header.data(), kHeaderSize);
  push_bytes(body, n);
  queued_ += kHeaderSize + n;
}

void TxQueue::append_inline(const HeaderBytes& header, const Payload& body) {
  note_frame_start();
  push_bytes(header.data(), kHeaderSize);
  for (const Slice& s : body.slices()) push_bytes(s.data, s.size);
  queued_ += kHeaderSize + body.size();
}

void TxQueue::append_raw(const std::uint8_t* p, std::size_t n) {
  // Raw bytes are not a frame: entered as an entry, so boundaries stay
  // decodable from frame headers.
  TxFrame f;
  f.has_header = false;
  f.body = Payload::copy_of(std::span<const std::uint8_t>(p, n));
  f.charged = 0;
  append_frame(std::move(f));
}

// The memory an entry keeps alive in this process: a streamed memfd is
// mapped one window at a time, the rest is held whole until written.
std::size_t TxQueue::held_bytes(const TxFrame& f) {
  return f.size() - (f.streamed ? f.streamed_len - std::min(f.streamed_len, kStreamWindow) : 0);
}

void TxQueue::charge_entry(Entry& e) {
  e.held = held_bytes(e.frame);
  if (account_) account_->charge(e.held);
}

void TxQueue::append_frame(TxFrame&& f) {
  queued_ += f.charged;
  Entry e;
  e.at = tail_;
  e.inline_before = inline_frames_;
  e.frame = std::move(f);
  charge_entry(e);
  frames_.push_back(std::move(e));
}

void TxQueue::push_front_frame(TxFrame&& f) {
  queued_ += f.charged;
  Entry e;
  e.at = head_;
  e.inline_before = inline_index_at(head_);
  e.sent = f.skip;
  e.frame = std::move(f);
  charge_entry(e);
  frames_.push_front(std::move(e));
}

TxFrame* TxQueue::head_frame() {
  if (frames_.empty() || frames_.front().at != head_) return nullptr;
  return &frames_.front().frame;
}

TxFrame TxQueue::pop_head_frame() {
  Entry& e = frames_.front();
  assert(e.at == head_ && e.sent == 0);
  TxFrame f = std::move(e.frame);
  queued_ -= f.charged;
  pop_front_entry();
  return f;
}

void TxQueue::pop_front_entry() {
  Entry& e = frames_.front();
  unmap_window(e);
  if (account_ && e.held) account_->release(e.held);
  frames_.pop_front();
}

bool TxQueue::map_window(Entry& e, std::size_t off, std::string& error) {
  if (e.window && off >= e.window_at && off < e.window_at + e.window_len) return true;
  unmap_window(e);
  const std::size_t size = e.frame.streamed->size();
  const std::size_t page = 4096;
  std::size_t at = off / page * page;
  std::size_t len = std::min(kStreamWindow, size - at);
  void* w = ::mmap(nullptr, len, PROT_READ, MAP_SHARED, e.frame.streamed->fd(), static_cast<off_t>(at));
  if (w == MAP_FAILED) {
    error = fmt::format("cannot map a window of the memfd body: {}", errno_text(errno));
    return false;
  }
  e.window = w;
  e.window_at = at;
  e.window_len = len;
  return true;
}

void TxQueue::unmap_window(Entry& e) {
  if (e.window) ::munmap(e.window, e.window_len);
  e.window = nullptr;
  e.window_len = 0;
}

TxQueue::Gather TxQueue::gather(iovec* iov, int max, bool fd_batches) {
  Gather g;
  std::uint64_t pos = head_;
  std::size_t fi = 0;  // next entry to consider
  auto add = [&](const void* p, std::size_t n) {
    if (n == 0) return;
    // Contiguous with the previous span (consecutive bytes of one block).
    if (g.iovcnt > 0 && static_cast<const std::uint8_t*>(iov[g.iovcnt - 1].iov_base) +
                                iov[g.iovcnt - 1].iov_len == p) {
      iov[g.iovcnt - 1].iov_len += n;
    } else {
      iov[g.iovcnt++] = {const_cast<void*>(p), n};
    }
    g.bytes += n;
  };
  // Adds bytes [skip, skip + n) of a span of `n`; returns what is left of skip.
  auto add_part = [&](const std::uint8_t* p, std::size_t n, std::size_t skip) {
    if (skip >= n) return skip - n;
    add(p + skip, n - skip);
    return std::size_t{0};
  };
  while (g.iovcnt < max) {
    std::uint64_t stop = fi < frames_.size() ? frames_[fi].at : tail_;
    while (pos < stop && g.iovcnt < max) {
      std::size_t in_block = static_cast<std::size_t>((pos - base_) % kTxBlockSize);
      std::size_t len = static_cast<std::size_t>(std::min<std::uint64_t>(stop - pos, kTxBlockSize - in_block));
      add(block_at(pos), len);
      pos += len;
    }
    if (pos < stop || fi >= frames_.size()) break;
    Entry& e = frames_[fi];
    TxFrame& f = e.frame;
    // A frame that would not fit whole waits for the next write, unless it is
    // first (then it goes in parts).
    if (g.bytes > 0 && g.iovcnt + 3 + static_cast<int>(f.body.slices().size()) > max) break;
    if (f.needs_fds_now()) {
      // Its fds go with its first byte: it starts a write of its own, or
      // joins the batch the write began with.
      const bool joins = fd_batches && !g.fd_frames.empty() &&
                         g.fds + f.wire_fds.size() <= kMaxFdsPerMessage;
      if (g.bytes > 0 && !joins) break;
      g.fd_frames.push_back(&f);
      g.fds += f.wire_fds.size();
    }
    std::size_t skip = e.sent;
    if (f.has_header) skip = add_part(f.header.data(), kHeaderSize, skip);
    if (f.prefixed) skip = add_part(f.prefix.data(), kFdPrefixSize, skip);
    // The body's slices from byte `from` of it up to byte `to`.
    auto add_body = [&](std::size_t from, std::size_t to) {
      std::size_t at = 0;
      for (const Slice& sl : f.body.slices()) {
        if (g.iovcnt == max) break;
        const std::size_t lo = std::max(at, from), hi = std::min(at + sl.size, to);
        if (lo < hi) skip = add_part(sl.data + (lo - at), hi - lo, skip);
        at += sl.size;
      }
    };
    if (f.streamed) {
      add_body(0, f.streamed_split);
      if (g.iovcnt == max) break;  // the range must not start before the bytes ahead of it
      if (skip >= f.streamed_len) {
        skip -= f.streamed_len;
      } else {
        const std::size_t from = f.streamed_at + skip, end = f.streamed_at + f.streamed_len;
        if (!map_window(e, from, g.error)) return g;
        const std::size_t in = from - e.window_at;
        add(static_cast<const std::uint8_t*>(e.window) + in, std::min(e.window_at + e.window_len, end) - from);
        skip = 0;
        // One window per write: the rest of the body goes next time.
        if (e.window_at + e.window_len < end) break;
      }
      add_body(f.streamed_split, f.body.size());
    } else {
      add_body(0, f.body.size());
    }
    ++fi;
  }
  // Only now is the batch known: its first frame says how many fds it holds
  // (none of these prefixes has been written yet: their fds are unsent).
  for (std::size_t i = 0; i < g.fd_frames.size(); ++i) {
    TxFrame& f = *g.fd_frames[i];
    if (!f.prefixed) continue;
    const bool head = i == 0 && g.fd_frames.size() > 1;
    std::uint16_t flags = static_cast<std::uint16_t>((f.prefix[4] << 8 | f.prefix[5]) & ~kFdFlagBatchHead);
    if (head) flags |= kFdFlagBatchHead;
    const std::uint16_t total = head ? static_cast<std::uint16_t>(g.fds) : 0;
    f.prefix[4] = static_cast<std::uint8_t>(flags >> 8);
    f.prefix[5] = static_cast<std::uint8_t>(flags);
    f.prefix[6] = static_cast<std::uint8_t>(total >> 8);
    f.prefix[7] = static_cast<std::uint8_t>(total);
  }
  return g;
}

// The header of the frame at `pos` in the log (it may straddle two blocks).
Header TxQueue::header_at(std::uint64_t pos) {
  std::uint8_t raw[kHeaderSize];
  for (std::size_t i = 0; i < kHeaderSize;) {
    std::size_t in_block = static_cast<std::size_t>((pos - base_) % kTxBlockSize);
    std::size_t len = std::min(kHeaderSize - i, kTxBlockSize - in_block);
    std::memcpy(raw + i, block_at(pos), len);
    i += len;
    pos += len;
  }
  return decode_header(raw);
}

// The inline frames appended before `pos`, a frame boundary at or after
// boundary_: those before boundary_, and those from there to `pos`.
std::uint64_t TxQueue::inline_index_at(std::uint64_t pos) {
  std::uint64_t n = boundary_index_;
  for (std::uint64_t p = boundary_; p + kHeaderSize <= pos; ++n) p += kHeaderSize + header_at(p).length;
  return n;
}

// After a write: boundary_ moves to head_ when head_ ends the inline bytes
// before the next entry (or the tail), which is a frame boundary; otherwise
// to the last first-frame-of-a-block start head_ has passed.
void TxQueue::sync_boundary() {
  const bool entry_next = !frames_.empty();
  if (head_ == (entry_next ? frames_.front().at : tail_)) {
    boundary_ = head_;
    boundary_index_ = entry_next ? frames_.front().inline_before : inline_frames_;
    return;
  }
  if (blocks_.empty() || head_ <= base_) return;
  for (std::size_t k = static_cast<std::size_t>((head_ - base_ - 1) / kTxBlockSize) + 1; k-- > 0;) {
    const BlockStart& b = starts_[k];
    if (b.at == BlockStart::kNone || b.at > head_) continue;
    if (b.at > boundary_) {
      boundary_ = b.at;
      boundary_index_ = b.index;
    }
    return;
  }
}

std::uint64_t TxQueue::frames_written() {
  // The inline frames head_ has passed whole since boundary_, counted now.
  const std::uint64_t limit = frames_.empty() ? head_ : std::min<std::uint64_t>(head_, frames_.front().at);
  std::uint64_t n = boundary_index_;
  for (std::uint64_t p = boundary_; p + kHeaderSize <= limit; ++n) {
    const std::uint64_t end = p + kHeaderSize + header_at(p).length;
    if (end > limit) break;
    p = end;
  }
  return entry_frames_written_ + n - unsent_inline_;
}

void TxQueue::free_blocks_before(std::uint64_t pos) {
  auto free_front = [this] {
    pool().put(blocks_.front());
    blocks_.pop_front();
    starts_.pop_front();
    if (account_) account_->release(kTxBlockSize);
  };
  while (!blocks_.empty() && pos - base_ >= kTxBlockSize) {
    free_front();
    base_ += kTxBlockSize;
  }
  // An empty log gives its last block back too, and starts afresh at tail_.
  if (head_ == tail_ && boundary_ == head_ && !blocks_.empty()) {
    free_front();
    base_ = tail_;
  }
}

std::size_t TxQueue::advance(std::size_t n) {
  std::size_t released = 0;
  while (n > 0) {
    std::uint64_t stop = frames_.empty() ? tail_ : frames_.front().at;
    if (head_ < stop) {
      std::size_t len = static_cast<std::size_t>(std::min<std::uint64_t>(n, stop - head_));
      head_ += len;
      n -= len;
      released += len;
      continue;
    }
    Entry& e = frames_.front();
    std::size_t left = e.frame.size() - e.sent;
    if (n < left) {
      e.sent += n;
      break;
    }
    n -= left;
    released += e.frame.charged;
    if (e.frame.has_header) ++entry_frames_written_;
    boundary_index_ = e.inline_before;
    pop_front_entry();
    boundary_ = head_;  // an entry ends on a frame boundary
  }
  queued_ -= std::min(queued_, released);
  sync_boundary();
  free_blocks_before(boundary_);
  return released;
}

Unsent TxQueue::clear() {
  Unsent u;
  auto note = [&u](const Header& h) {
    if (h.is_dead()) {
      ++u.dead;
    } else if (h.reply_to == 0) {
      if (u.other_headers.size() < Unsent::kOtherKept) u.other_headers.push_back(h);
      ++u.other;
    } else {
      u.wanting_reply.push_back(h);
    }
  };
  // Inline frames from boundary_: those head_ passed whole were written;
  // the others (one received in part, and the rest) were not.
  auto inline_until = [&](std::uint64_t stop) {
    while (boundary_ + kHeaderSize <= stop) {
      Header h = header_at(boundary_);
      boundary_ += kHeaderSize + h.length;
      ++boundary_index_;
      if (boundary_ > head_) {
        note(h);
        ++unsent_inline_;
      }
    }
    boundary_ = stop;
  };
  while (!frames_.empty()) {
    inline_until(frames_.front().at);
    TxFrame& f = frames_.front().frame;
    if (f.original) u.originals.push_back(std::move(f.original));
    else if (f.has_header) note(decode_header(f.header.data()));
    pop_front_entry();
  }
  inline_until(tail_);
  head_ = boundary_ = tail_;
  queued_ = 0;
  free_blocks_before(tail_);
  return u;
}

}  // namespace spindle
