// The stream's write side. Frames are queued in its TxQueue (inline copies of
// small bodies, owned payloads for large ones, held messages while the
// handshake runs) and the stream does its own non-blocking writev()/sendmsg()
// of as many as fit, waiting for writability only when the socket is full:
// one syscall for a whole batch, header and body together. The TxGate
// (port.h) is checked first: an application thread may be writing a frame of
// its own right now, and then its kick brings the broker back here. Each
// write releases what it took from the output gauge, which is what lets
// held senders be read again (note_below_mark).
#include "stream/stream.h"

#include <signal.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <string>

#include <fmt/format.h>

#include "broker/errors.h"
#include "broker/log.h"
#include "broker/sigpipe.h"
#include "stream/fd_control.h"

namespace spindle {
namespace {

constexpr int kMaxIov = IOV_MAX < 1024 ? IOV_MAX : 1024;

}  // namespace

void Stream::queue_raw(const std::vector<std::uint8_t>& bytes) {
  if (bytes.empty()) return;
  tx_.append_raw(bytes.data(), bytes.size());
  note_queued();
}

void Stream::note_queued() {
  if (busy_) return;
  busy_ = true;
  port_->gate.mark_queued();
}

void Stream::enqueue(Message&& m, std::size_t charged) {
  if (state_ == StreamState::kHandshaking) {
    held_.push_back(HeldMessage{std::move(m), charged});
    return;
  }
  push_frame(std::move(m), charged);
}

void Stream::enqueue_frame(const Header& header, InFrame& f, std::size_t charged) {
  const std::size_t n = f.body_size();
  if (state_ == StreamState::kHandshaking || n > kInlineBodyMax || header.enc == kEncFds) {
    Message m = f.take();
    m.header = header;
    return enqueue(std::move(m), charged);
  }
  Header h = header;
  h.length = static_cast<std::uint32_t>(n);
  const std::size_t wire = kHeaderSize + n;
  if (charged < wire) port_->gauge.charge(wire - charged);
  tx_.append_inline_with(encode_header(h), n, [&f](auto&& push) { f.for_each_body_span(push); });
  note_queued();
}

void Stream::enqueue_bytes(const Header& header, std::span<const std::uint8_t> body,
                           std::size_t charged) {
  if (state_ == StreamState::kHandshaking || body.size() > kInlineBodyMax) {
    Message m{header, Payload::copy_of(body)};
    return enqueue(std::move(m), charged);
  }
  Header h = header;
  h.length = static_cast<std::uint32_t>(body.size());
  const std::size_t wire = kHeaderSize + body.size();
  if (charged < wire) port_->gauge.charge(wire - charged);
  tx_.append_inline(encode_header(h), body.data(), body.size());
  note_queued();
}

void Stream::flush() {
  if (write_armed_) {
    // Waiting for the peer to take what is queued. The queue may have grown
    // past the mark since the socket filled (control messages and dead
    // replies are queued over it): that starts the stall timer too.
    if (state_ != StreamState::kClosed && stalled()) arm_stall_timer();
    return;
  }
  if (state_ == StreamState::kClosed || write_shut_) return;
  if (!tx_.empty() && !port_->gate.broker_may_write()) return;  // the writer's kick brings us back
  const int fd = writer().native_handle();
  // Several SF frames' fds in one sendmsg when the peer binds them by count;
  // after a refused batch, one frame per sendmsg, so that only the frame the
  // kernel refuses fails (send_fd_frame_failed).
  bool fd_batches = peer_takes_fd_batches();
  while (!tx_.empty()) {
    iovec iov[kMaxIov];
    TxQueue::Gather g = tx_.gather(iov, kMaxIov, fd_batches);
    if (!g.error.empty()) return close(g.error);
    ssize_t n;
    if (is_socket_) {
      msghdr mh{};
      mh.msg_iov = iov;
      mh.msg_iovlen = static_cast<std::size_t>(g.iovcnt);
      FdControl control;
      if (!g.fd_frames.empty()) {
        int fds[kMaxFdsPerMessage];
        std::size_t k = 0;
        for (TxFrame* f : g.fd_frames)
          for (int x : f->wire_fds) fds[k++] = x;
        control.attach(mh, std::span<const int>(fds, k));
      }
      n = ::sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    } else {
      broker_.quiet_sigpipe();
      n = ::writev(fd, iov, g.iovcnt);
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return arm_write();
      int err = errno;
      if (g.fd_frames.size() > 1 && fd_batches) {
        fd_batches = false;  // retried frame by frame: only the frame at fault fails
        continue;
      }
      if (!g.fd_frames.empty() && send_fd_frame_failed(err)) continue;
      if (err == EPIPE && !is_socket_) sigpipe::consume_pending();
      if (err == EPIPE || err == ECONNRESET)
        return close("peer closed the connection (" + std::string(errno_text(err)) + ")");
      return close(fmt::format("write: {}", errno_text(err)));
    }
    ++stats_.writes;
    stats_.bytes_out += static_cast<std::uint64_t>(n);
    // The kernel holds its own references now, for every frame of the
    // batch (even one whose bytes are not all written yet); ours may close.
    for (TxFrame* f : g.fd_frames) {
      f->fds_sent = true;
      f->fds_hold = {};
      f->body_hold.reset();
      if (f->original) {
        f->original->fds = {};
        f->original->sealed_body.reset();
      }
    }
    stats_.fds_out += g.fds;
    std::size_t released = tx_.advance(static_cast<std::size_t>(n));
    if (released) {
      port_->gauge.release(released);
      note_below_mark();
    }
    if (static_cast<std::size_t>(n) < g.bytes) return arm_write();
  }
  if (busy_ && state_ == StreamState::kOpen) {
    busy_ = false;
    port_->gate.clear_busy();
  }
  after_write();
}

// The queue is empty: finish a close or a goodbye that waited for it.
void Stream::after_write() {
  if (close_after_flush_) return close(close_reason_);
  if (state_ == StreamState::kDraining) {
    half_close();
    if (eof_seen_ || (drain_started_here_ && opts_.close_when_drained))
      close(drain_started_here_ ? "drained" : "peer closed the connection");
  }
}

// On the broker thread, from an application thread's direct write: the rest
// of its frame (to go first), a failure, or only a kick (the broker queued or
// wanted to close meanwhile).
void Stream::take_over(TxFrame* rest, const std::string& error) {
  if (rest) {
    if (state_ == StreamState::kClosed) {
      log().debug("stream={} closed before the rest of a direct write could be sent", name());
      port_->gauge.release(rest->charged);
    } else {
      tx_.push_front_frame(std::move(*rest));
      busy_ = true;
    }
    port_->gate.clear_rest();
  }
  if (state_ == StreamState::kClosed) return close_fds();
  if (!error.empty()) return close(error);
  flush();
}

void Stream::drain() {
  if (state_ == StreamState::kClosed || state_ == StreamState::kDraining) return;
  drain_started_here_ = true;
  // A handshake in progress finishes first (the broker's grace deadline bounds
  // it), so what was queued behind it is still delivered.
  if (state_ == StreamState::kHandshaking) return;
  state_ = StreamState::kDraining;
  port_->gate.close();
  flush();
}

void Stream::half_close() {
  if (write_shut_ || state_ == StreamState::kClosed) return;
  // After the writer's kick, or once the rest of its frame is written.
  if (port_->gate.load() & (TxGate::kUser | TxGate::kRest)) return;
  write_shut_ = true;
  if (is_socket_ && !wr_) {
    if (::shutdown(rd_.native_handle(), SHUT_WR) < 0 && errno != ENOTCONN)
      log().debug("stream={} shutdown(SHUT_WR): {}", name(), errno_text(errno));
  } else if (wr_) {
    std::error_code ignored;
    wr_->close(ignored);
  }
}

}  // namespace spindle
