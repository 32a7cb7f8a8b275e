#include "stream/rx_buffer.h"

#include <algorithm>
#include <cassert>
#include <cstring>
#include <utility>
#include <vector>

#include "broker/broker.h"
#include "broker/sole_owner.h"

namespace spindle {
namespace {

// The chunks nobody holds, kept for this thread's next read. A broker thread
// reads its streams one at a time and most let their chunk go before the
// next reads, so a few cover any number of connections; more are freed.
// Only a broker's own thread keeps them (as TxQueue's blocks): a caller that
// leads a loop for a while, or a hosted loop's thread, is not one, and its
// streams keep a spare each instead, as they did before the pool.
class ChunkPool {
 public:
  ChunkPool() { free_.reserve(kPooledChunks); }
  std::shared_ptr<Chunk> take() {
    if (free_.empty()) return std::make_shared<Chunk>(kChunkSize);
    std::shared_ptr<Chunk> c = std::move(free_.back());
    free_.pop_back();
    return c;
  }
  void give(std::shared_ptr<Chunk> c) {
    if (free_.size() < kPooledChunks) free_.push_back(std::move(c));
  }

 private:
  static constexpr std::size_t kPooledChunks = 4;
  std::vector<std::shared_ptr<Chunk>> free_;
};

thread_local ChunkPool chunk_pool;

}  // namespace

std::shared_ptr<Chunk> RxBuffer::new_chunk() {
  if (spare_) return std::move(spare_);
  return chunk_pool.take();
}

// A chunk leaves the deque: back to the pool if nobody holds it (the spare
// off a broker's own thread; freed when the buffer goes), otherwise charged
// to the peer until the payloads holding it are gone.
void RxBuffer::retire(std::shared_ptr<Chunk> c, bool keep) {
  if (sole_owner(c)) {
    if (!keep) return;
    if (Broker::on_an_own_thread()) chunk_pool.give(std::move(c));
    else if (!spare_) spare_ = std::move(c);
    return;
  }
  if (account_) {
    account_->charge(c->capacity());
    c->charge_to(Charge(account_, c->capacity()));
  }
}

RxBuffer::~RxBuffer() {
  for (std::shared_ptr<Chunk>& c : chunks_) retire(std::move(c), /*keep=*/false);
}

void RxBuffer::let_go(bool stash) {
  if (!Broker::on_an_own_thread()) return;  // no pool here: the chunk stays
  if (readable_ > (stash ? kStashMax : 0) || chunks_.size() != 1 || !sole_owner(chunks_.front())) return;
  if (readable_ > 0) {
    // Part of a frame: its bytes, not the chunk, wait for the rest. Charged
    // as a retired chunk is, whatever the account holds: they are held.
    stash_ = std::make_unique_for_overwrite<std::uint8_t[]>(readable_);
    std::memcpy(stash_.get(), chunks_.front()->data() + head_, readable_);
    stash_charge_ = Charge(account_, 0);
    stash_charge_.add(readable_);
  }
  chunk_pool.give(std::move(chunks_.front()));  // retire()'s own-thread case, checked above
  chunks_.clear();
  head_ = tail_ = 0;
}

void RxBuffer::unstash() {
  if (!stash_) return;
  std::shared_ptr<Chunk> c = new_chunk();
  std::memcpy(c->data(), stash_.get(), readable_);
  chunks_.push_back(std::move(c));
  head_ = 0;
  tail_ = readable_;
  stash_.reset();
  stash_charge_.reset();
}

std::span<std::uint8_t> RxBuffer::write_space() {
  unstash();
  if (chunks_.empty()) {
    chunks_.push_back(new_chunk());
    head_ = tail_ = 0;
  } else if (tail_ == chunks_.back()->capacity()) {
    if (chunks_.size() == 1 && readable_ <= kMovedTailMax) {
      move_tail_to_fresh_chunk();
    } else {
      chunks_.push_back(new_chunk());
      tail_ = 0;
    }
  }
  Chunk& back = *chunks_.back();
  return {back.data() + tail_, back.capacity() - tail_};
}

// The full chunk's unread tail (part of a frame) moves to the start of a
// fresh one, so that the frame does not straddle the two. Straddling, it was
// taken as a Payload holding both, which held the full chunk as it retired:
// that chunk could not become the spare, and every 128 KiB of small messages
// cost an allocation (bench_core's allocs_per_msg_recv, 0.001). Now the full
// chunk's frames are all gone by the time it retires, and two chunks take
// turns. Only a small tail moves: a larger frame's bytes are never copied.
void RxBuffer::move_tail_to_fresh_chunk() {
  std::shared_ptr<Chunk> fresh = new_chunk();
  std::shared_ptr<Chunk>& full = chunks_.front();
  std::memcpy(fresh->data(), full->data() + head_, readable_);
  retire(std::exchange(full, std::move(fresh)));
  head_ = 0;
  tail_ = readable_;
}

void RxBuffer::commit(std::size_t n) {
  assert(!chunks_.empty() && tail_ + n <= chunks_.back()->capacity());
  tail_ += n;
  readable_ += n;
}

void RxBuffer::peek(std::uint8_t* out, std::size_t n) const {
  assert(n <= readable_);
  if (stash_) {
    std::memcpy(out, stash_.get(), n);
    return;
  }
  std::size_t off = head_;
  for (std::size_t i = 0; n > 0; ++i) {
    const Chunk& c = *chunks_[i];
    std::size_t end = (i + 1 == chunks_.size()) ? tail_ : c.capacity();
    std::size_t len = std::min(n, end - off);
    std::memcpy(out, c.data() + off, len);
    out += len;
    n -= len;
    off = 0;
  }
}

Payload RxBuffer::take(std::size_t n) {
  assert(n <= readable_);
  unstash();
  Payload p;
  while (n > 0) {
    const std::shared_ptr<Chunk>& c = chunks_.front();
    std::size_t end = (chunks_.size() == 1) ? tail_ : c->capacity();
    std::size_t len = std::min(n, end - head_);
    p.append(Slice{c, c->data() + head_, len});
    head_ += len;
    readable_ -= len;
    n -= len;
    release_consumed_front();
  }
  return p;
}

void RxBuffer::drop(std::size_t n) {
  assert(n <= readable_);
  unstash();
  while (n > 0) {
    std::size_t end = (chunks_.size() == 1) ? tail_ : chunks_.front()->capacity();
    std::size_t len = std::min(n, end - head_);
    head_ += len;
    readable_ -= len;
    n -= len;
    release_consumed_front();
  }
}

void RxBuffer::read_into(std::uint8_t* out, std::size_t n) {
  peek(out, n);
  drop(n);
}

// Retires fully consumed chunks. The last chunk is kept for further writes; if
// nobody else references it, its space is rewound so it can be reused whole.
void RxBuffer::release_consumed_front() {
  while (!chunks_.empty()) {
    bool last = chunks_.size() == 1;
    std::size_t end = last ? tail_ : chunks_.front()->capacity();
    if (head_ < end) return;
    if (!last) {
      retire(std::move(chunks_.front()));
      chunks_.pop_front();
      head_ = 0;
      continue;
    }
    if (sole_owner(chunks_.front())) {
      head_ = tail_ = 0;
    } else if (tail_ == chunks_.front()->capacity()) {
      retire(std::move(chunks_.front()));
      chunks_.pop_front();
      head_ = tail_ = 0;
    }
    return;
  }
}

}  // namespace spindle
