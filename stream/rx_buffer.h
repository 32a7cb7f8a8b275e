// RxBuffer: received bytes, held in a deque of 128 KiB chunks.
//
// The reader asks for write_space(), reads into it and commit()s what arrived.
// The consumer peeks at a prefix (a frame header), then take()s a prefix as a
// Payload that shares the chunks, or drop()s it. A chunk that a payload still
// references is never reused for new data before the payload lets go; bytes
// after the payload's range may still be appended to it, which is safe because
// nobody reads them until they are committed.
//
// Memory: a chunk is reused in place once nobody else holds it, and a small
// frame's start at the end of a full chunk is copied to the next, so that no
// frame holds two. A chunk nobody holds goes back to its thread's pool (a
// few chunks, LIFO) when it retires, and so does the one left when the
// stream waits for input with nothing unread (let_go()). So an idle
// connection holds no receive memory, a broker's streams take turns with a
// few warm chunks, and a peer whose messages are handled and let go costs no
// allocation per chunk. Before the pool, each connection kept its chunk and
// a spare, and a router with 256 busy clients held 64 MiB in them. Only a
// broker's own thread has a pool (Broker::on_an_own_thread(): a thread that
// leads a loop for a while would keep its chunks after it stopped); a
// stream read elsewhere (a hosted loop) keeps its chunk and one spare.
//
// A stream that waits for input in the middle of a frame (the peer sent part
// of it) does not keep its chunk for those few bytes either: let_go() copies
// them into a stash of their exact size, charged to the peer's account, and
// gives the chunk to the pool. The next read takes a chunk and copies them
// back to its start; reads in between (peek, visit) are served from the
// stash. Before, such a connection held its whole chunk, charged to nobody,
// until the frame was finished or the stall rule cut it off: a peer with
// thousands of connections, each leaving a frame unfinished, made a router
// hold 128 KiB per connection outside every budget.
//
// A chunk retired while payloads still hold it is charged, whole, to the
// peer's account until they let go (a 64-byte message kept by a handler
// pins 128 KiB, and that is what it costs). So is every chunk still held
// when the buffer goes (its stream closed): before, the chunk being filled
// was charged to nobody once its peer left, and a peer that reconnected in a
// loop, each time leaving one message queued somewhere, pinned 128 KiB per
// connection uncharged.
//
// Thread safety: owned by one Stream and used only on the broker thread (the
// pool is that thread's; the destructor, which may run elsewhere, frees).
#pragma once

#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <deque>
#include <memory>
#include <span>

#include "stream/payload.h"

namespace spindle {

inline constexpr std::size_t kChunkSize = 128 * 1024;
// The most unread bytes a full chunk hands on to the next by copying them
// (a frame's start; see move_tail_to_fresh_chunk): at most an eighth of the
// chunk, copied once per chunk.
inline constexpr std::size_t kMovedTailMax = 16 * 1024;
// The most unread bytes let_go() stashes: a frame that stays in the chunks
// has a body under 64 KiB (larger bodies get a buffer of their own once
// their header is in, stream/parser.h), plus its header.
inline constexpr std::size_t kStashMax = 64 * 1024 + 64;

class RxBuffer {
 public:
  RxBuffer() = default;
  ~RxBuffer();
  RxBuffer(const RxBuffer&) = delete;
  RxBuffer& operator=(const RxBuffer&) = delete;

  // Free space at the tail; never empty (a new chunk is appended if needed).
  std::span<std::uint8_t> write_space();
  void commit(std::size_t n);
  // Copies `n` bytes (n <= readable()) into `out` without consuming them.
  void peek(std::uint8_t* out, std::size_t n) const;
  // The first `n` readable bytes where they lie when they are contiguous
  // (n <= readable()), else null: a frame header read in place.
  const std::uint8_t* front(std::size_t n) const {
    if (stash_) return stash_.get();
    const std::size_t end = chunks_.size() == 1 ? tail_ : chunks_.front()->capacity();
    return end - head_ >= n ? chunks_.front()->data() + head_ : nullptr;
  }
  // Consumes `n` bytes and returns them as slices of the chunks.
  Payload take(std::size_t n);
  void drop(std::size_t n);
  // Copies `n` bytes out and consumes them.
  void read_into(std::uint8_t* out, std::size_t n);

  // Calls fn(const std::uint8_t*, std::size_t) for each contiguous span of
  // the `n` readable bytes that start `offset` bytes in, without consuming.
  template <class F>
  void visit(std::size_t offset, std::size_t n, F&& fn) const;

  // The stream is about to wait for input. On a broker's own thread, when
  // nobody else holds its one chunk, gives that chunk back to the thread's
  // pool: with nothing unread; or, when `stash` (the stream waits on its
  // peer), after moving what is unread (part of a frame, at most kStashMax
  // bytes) into a stash charged to the account. Elsewhere the chunk stays.
  void let_go(bool stash);
  // Puts stashed bytes back at the start of a chunk and drops their charge.
  // Every use that needs a chunk does this itself; a stream calls it before
  // it checks its peer's limit, which the stash's charge would count.
  void unstash();

  std::size_t readable() const { return readable_; }
  std::size_t chunk_count() const { return chunks_.size(); }
  // Unread bytes held in the stash instead of a chunk.
  std::size_t stashed() const { return stash_ ? readable_ : 0; }
  // Chunks retired while still held get charged here (may be null).
  void set_account(std::shared_ptr<Account> a) { account_ = std::move(a); }

 private:
  std::shared_ptr<Chunk> new_chunk();
  void move_tail_to_fresh_chunk();
  void release_consumed_front();
  void retire(std::shared_ptr<Chunk> c, bool keep = true);

  std::shared_ptr<Account> account_;
  std::unique_ptr<std::uint8_t[]> stash_;  // readable_ bytes, while no chunk is held
  Charge stash_charge_;
  std::shared_ptr<Chunk> spare_;  // off a broker's own thread only
  std::deque<std::shared_ptr<Chunk>> chunks_;
  std::size_t head_ = 0;  // read offset in chunks_.front()
  std::size_t tail_ = 0;  // write offset in chunks_.back()
  std::size_t readable_ = 0;
};

template <class F>
void RxBuffer::visit(std::size_t offset, std::size_t n, F&& fn) const {
  if (stash_) {
    if (n > 0) fn(stash_.get() + offset, n);
    return;
  }
  std::size_t off = head_ + offset;
  for (std::size_t i = 0; n > 0; ++i) {
    const Chunk& c = *chunks_[i];
    std::size_t end = (i + 1 == chunks_.size()) ? tail_ : c.capacity();
    if (off >= end) {
      off -= end;
      continue;
    }
    std::size_t len = std::min(n, end - off);
    fn(c.data() + off, len);
    n -= len;
    off = 0;
  }
}

}  // namespace spindle
