// What a peer may make the stream hold, and for how long (docs/PROTOCOL.md
// §14). Reading stops while the peer's account is over its limit, or while
// an untrusted peer's next large body does not fit its allowance; a release
// resumes it (ReadResumer). The stall timer disconnects a peer that keeps us
// waiting on what only it can end: it does not read what is queued for it, or
// (untrusted) its full queue holds up its writers for a whole stall_timeout.
// An untrusted peer's body, once begun, must arrive at kMinBodyRate. Holds
// (hold_input, hold_for_peer) stop reading for the router's own reasons: a
// destination over its mark, or a log budget spent.
#include "stream/parser.h"
#include "stream/stream.h"

#include <algorithm>
#include <cstdint>
#include <string>

#include <fmt/format.h>

#include "broker/log.h"

namespace spindle {
// Over the memory limit: stop reading. A stall timer disconnects a peer that
// stays over while its own output makes no progress (it neither reads what we
// hold for it nor lets us drop anything).
//
// A frame whose body is being read into a buffer of its own is finished
// first, even over the limit: its whole size was charged when the buffer was
// made, and only completing it (and dispatching it) can release that charge.
// Pausing there would wait forever for a release that needs this very read.
bool Stream::over_limit() {
  if (memory_wait_) return true;
  if ((parser_ && parser_->body_wants_bytes()) || !account_->over_awaiting_relief()) return false;
  if (!paused_) {
    paused_ = true;
    ++stats_.read_pauses;
    log().debug("stream={} reading paused: the peer holds {} bytes (limit {})", name(),
                account_->held(), account_->limit());
    arm_stall_timer();
  }
  return true;
}

bool Stream::stalled() const {
  if (paused_) return true;
  return opts_.untrusted && port_->gauge.queued() > port_->gauge.high_water_mark();
}

void Stream::arm_stall_timer() {
  if (opts_.stall_timeout.count() <= 0 || stall_armed_) return;
  stall_armed_ = true;
  stall_mark_ = stats_.bytes_out;
  stall_timer_.expires_after(opts_.stall_timeout);
  stall_timer_.async_wait([self = shared_from_this()](const std::error_code& ec) {
    self->stall_armed_ = false;
    if (ec == asio::error::operation_aborted || self->state_ == StreamState::kClosed || !self->stalled())
      return;
    // Whoever writes to an untrusted peer over its mark is held until the
    // queue is back under it (Router::over_mark). Draining it slowly moves
    // bytes_out, but must not hold the others for good: a client that reads
    // just enough to look alive while it keeps its queue full (its own calls'
    // large answers refill it) would freeze every peer that answers it.
    const auto held_for = std::chrono::steady_clock::now() - self->watch_since_;
    if (self->opts_.untrusted && self->watch_mark_ && held_for >= self->opts_.stall_timeout)
      return self->close(fmt::format(
          "the peer's queue stayed over its high-water mark ({} bytes queued, mark {}) and held up "
          "the peers writing to it for {} ms",
          self->port_->gauge.queued(), self->port_->gauge.high_water_mark(),
          std::chrono::duration_cast<std::chrono::milliseconds>(held_for).count()));
    if (self->stats_.bytes_out != self->stall_mark_) return self->arm_stall_timer();
    // Paused with nothing queued for the peer: what it is charged for is held
    // on this side (a received body the application keeps), which only a
    // release here can end. The peer is not failing to read; it stays paused.
    if (self->paused_ && self->port_->gauge.queued() == 0) return self->arm_stall_timer();
    if (self->paused_)
      return self->close(fmt::format("the peer stayed {} its memory limit ({} bytes held, limit {}) "
                                     "for {} ms without reading",
                                     self->memory_wait_ ? "too close to" : "over",
                                     self->account_->held(), self->account_->limit(),
                                     self->opts_.stall_timeout.count()));
    self->close(fmt::format("the peer took nothing of the {} bytes queued for it (high-water mark {}) "
                            "for {} ms",
                            self->port_->gauge.queued(), self->port_->gauge.high_water_mark(),
                            self->opts_.stall_timeout.count()));
  });
}

void Stream::resume_reading() {
  if (!paused_ || state_ == StreamState::kClosed) return;
  if (account_->over_awaiting_relief()) return;  // another release will bring us back
  paused_ = false;
  stall_timer_.cancel();
  log().debug("stream={} reading resumed", name());
  // A body's header waits in the buffer: ask for its room again (the parse
  // pauses again if there is still none). Frames the pause cut short go
  // before the next read.
  if (std::exchange(memory_wait_, false)) input_left_ = true;
  if (input_left_) return queue_input_turn();
  arm_read();
}

std::uint32_t untrusted_receive_limit(std::uint32_t max_message_size, std::size_t peer_limit,
                                      std::size_t global_limit) {
  return static_cast<std::uint32_t>(
      std::min<std::size_t>({max_message_size, peer_limit, global_limit}));
}

void Stream::make_parser() {
  const std::uint32_t max =
      opts_.untrusted ? untrusted_receive_limit(opts_.max_message_size, opts_.memory_limit,
                                                opts_.budget ? opts_.budget->limit() : SIZE_MAX)
                      : opts_.max_message_size;
  parser_.emplace(rx_, max);
  parser_->set_account(account_, peer_charge());
}

// An untrusted peer's large body does not fit its allowance yet: stop reading
// (the header stays in the buffer) until a release makes room. Waiting on
// memory the peer itself holds (its queue, which it does not read) ends as
// any stall does.
void Stream::wait_for_memory(std::size_t body_size) {
  if (paused_) return;
  paused_ = memory_wait_ = true;
  ++stats_.read_pauses;
  log().debug("stream={} reading paused: a {}-byte body does not fit the peer's allowance yet "
              "(it holds {} of {})",
              name(), body_size, account_->held(), account_->limit());
  arm_stall_timer();
}

// The charge for a body is held from its header on. An untrusted peer that
// begins a body and then trickles it (or stops) would hold that charge for
// good, and a few such clients would fill the router's global budget: the
// body must arrive within one stall_timeout plus its size at kMinBodyRate.
void Stream::watch_body() {
  if (!opts_.untrusted || opts_.stall_timeout.count() <= 0 || !parser_->body_wants_bytes() ||
      body_watched_ == parser_->bodies_begun())
    return;
  body_watched_ = parser_->bodies_begun();
  const std::size_t size = parser_->body_size();
  const auto allowed = opts_.stall_timeout + std::chrono::milliseconds(size * 1000 / kMinBodyRate);
  body_timer_.expires_after(allowed);
  body_timer_.async_wait([self = shared_from_this(), seq = body_watched_, size, allowed](
                             const std::error_code& ec) {
    if (ec == asio::error::operation_aborted || self->state_ == StreamState::kClosed) return;
    if (self->parser_->bodies_begun() != seq || !self->parser_->body_wants_bytes()) return;
    self->close(fmt::format("the peer sent {} of a {}-byte message in {} ms (a message must arrive "
                            "at {} MiB/s or faster once begun)",
                            self->parser_->body_filled(), size, allowed.count(),
                            kMinBodyRate >> 20));
  });
}

void Stream::hold_input(std::chrono::milliseconds d) {
  if (input_held_ || state_ == StreamState::kClosed) return;
  input_held_ = true;
  hold_timer_.expires_after(d);
  hold_timer_.async_wait([self = shared_from_this()](const std::error_code& ec) {
    if (ec == asio::error::operation_aborted || self->state_ == StreamState::kClosed) return;
    self->input_held_ = false;
    // Frames may be left from the batch the hold cut short: they go first.
    self->input_left_ = true;
    self->queue_input_turn();
  });
}

void Stream::hold_for_peer() {
  if (state_ == StreamState::kClosed) return;
  if (peer_holds_++ == 0) ++stats_.peer_holds;
}

void Stream::release_peer_hold() {
  if (peer_holds_ == 0 || --peer_holds_ > 0 || state_ == StreamState::kClosed) return;
  // Frames may be left from the batch the hold cut short: they go first.
  input_left_ = true;
  queue_input_turn();
}

void Stream::notify_below_mark() {
  if (state_ == StreamState::kClosed) return;
  if (!watch_mark_) watch_since_ = std::chrono::steady_clock::now();
  watch_mark_ = true;
  // Already under it (written since the charge): say so now.
  note_below_mark();
}

void Stream::note_below_mark() {
  if (!watch_mark_ || port_->gauge.queued() >= port_->gauge.high_water_mark()) return;
  watch_mark_ = false;
  listener_->on_stream_below_mark(*this);
}

// A frame whose body is under kDirectBodyThreshold waits in the receive
// chunks until it is whole: the chunk being filled is charged to nobody
// while it does, and no other deadline applies (watch_body times only large
// bodies, the stall timer only a paused link). An untrusted peer that
// leaves such a frame unfinished is disconnected once an honest sender
// would have finished it: stall_timeout plus its largest size at
// kMinBodyRate (at most twice that, see below). Not while reading is
// paused or held: then the wait is ours (reading resumes through
// process_input, which times the frame afresh).
void Stream::watch_partial() {
  if (!opts_.untrusted || opts_.stall_timeout.count() <= 0 || !partial_frame_waits_on_peer()) return;
  // One wait at a time, never re-armed per batch (most reads end inside a
  // frame: that would cost a timer cancel and completion per read). When it
  // fires after frames were completed, the frame partial then gets a wait of
  // its own: a frame is cut off after one to two allowances.
  if (partial_watched_) return;
  partial_watched_ = true;
  partial_mark_ = stats_.messages_in;
  const auto allowed =
      opts_.stall_timeout + std::chrono::milliseconds(kDirectBodyThreshold * 1000 / kMinBodyRate);
  partial_timer_.expires_after(allowed);
  partial_timer_.async_wait([self = shared_from_this(), allowed](const std::error_code& ec) {
    if (ec == asio::error::operation_aborted || self->state_ == StreamState::kClosed) return;
    self->partial_watched_ = false;
    if (self->stats_.messages_in != self->partial_mark_ || !self->partial_frame_waits_on_peer())
      return self->watch_partial();  // it finished (a later one may be partial), or waits for us
    self->close(fmt::format("the peer left a frame unfinished for {} ms ({} bytes of it arrived; a "
                            "frame must arrive at {} MiB/s or faster once begun)",
                            allowed.count(), self->rx_.readable(), kMinBodyRate >> 20));
  });
}

// Part of a small frame waits in the receive chunks, and on the peer: not
// on us (reading paused or held), nor a large body's own buffer (watch_body).
bool Stream::partial_frame_waits_on_peer() const {
  return rx_.readable() > 0 && !paused_ && !input_stopped() && !parser_->body_wants_bytes();
}

// An untrusted peer's fds are held from their arrival until the frame they
// came with is complete (in a batch, until the frames after it are too). A
// peer that never completes them would pin them, and with a few connections
// the process's fd budget, for good: a batch not bound whole within
// stall_timeout disconnects the peer. A large body under way is exempt while
// it lasts: it has its own deadline (watch_body).
void Stream::watch_fds() {
  if (!opts_.untrusted || opts_.stall_timeout.count() <= 0 || fds_watched_ || !holds_unbound_fds())
    return;
  fds_watched_ = true;
  fds_mark_ = batches_done_;
  fds_timer_.expires_after(opts_.stall_timeout);
  fds_timer_.async_wait([self = shared_from_this()](const std::error_code& ec) {
    if (ec == asio::error::operation_aborted || self->state_ == StreamState::kClosed) return;
    self->fds_watched_ = false;
    if (!self->holds_unbound_fds()) return;
    if (self->batches_done_ != self->fds_mark_ || (self->parser_ && self->parser_->body_wants_bytes()))
      return self->watch_fds();
    std::size_t held = self->batch_.fds.size() - std::min(self->bound_, self->batch_.fds.size());
    for (const FdBatch& b : self->rx_fds_) held += b.fds.size();
    self->close(fmt::format("the peer sent {} fds with frames it did not complete within {} ms", held,
                            self->opts_.stall_timeout.count()));
  });
}

}  // namespace spindle
