// Reads: the stream's own non-blocking recvmsg() (read() on a pipe) straight
// into the parser's read target (a receive chunk or a large message's own
// body buffer), one read per broker turn so one busy peer cannot starve the
// others. recvmsg rather than Asio's async_read_some because fds arrive as
// ancillary data (MSG_CMSG_CLOEXEC, MSG_CTRUNC checked on every call). After
// a read that filled its target the next one is posted (more is likely
// waiting); after a short read the stream waits for readability. Writes: the
// stream does its own non-blocking writev()/sendmsg() of many frames and
// waits for writability only when the socket is full; an SF frame starts its
// own sendmsg and carries its fds as SCM_RIGHTS. The fd-specific steps
// (receiving and binding fds, framing and refusing) are in stream_fds.cpp.
#include "stream/stream.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <system_error>

#include <asio/post.hpp>
#include <fmt/format.h>

#include "broker/errors.h"
#include "broker/log.h"

namespace spindle {
namespace {

constexpr int kMaxIov = IOV_MAX < 1024 ? IOV_MAX : 1024;
constexpr std::size_t kSmallFrame = 2048;          // copied into the staging buffer
constexpr std::size_t kStagingSize = 256 * 1024;   // per write, at most

void set_nonblocking(int fd) {
  int fl = ::fcntl(fd, F_GETFL);
  if (fl < 0 || ::fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0)
    throw std::system_error(errno, std::generic_category(), "fcntl(O_NONBLOCK)");
}

bool fd_is_socket(int fd) {
  struct stat st;
  if (::fstat(fd, &st) < 0) throw std::system_error(errno, std::generic_category(), "fstat");
  return S_ISSOCK(st.st_mode);
}

// SIGPIPE is blocked on the broker thread; a write to a closed pipe leaves one
// pending. Consume it so it is never delivered later.
void consume_pending_sigpipe() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGPIPE);
  struct timespec zero {};
  while (::sigtimedwait(&set, nullptr, &zero) == SIGPIPE) {
  }
}

// A larger kernel buffer lets a bulk transfer move more per wake-up of each
// side (the default ~208 KiB means one epoll round per 208 KiB). The kernel
// caps the request at net.core.{w,r}mem_max; a refusal only costs speed.
constexpr int kSocketBuffer = 4 << 20;
void enlarge_socket_buffers(int fd, const std::string& name) {
  for (int opt : {SO_SNDBUF, SO_RCVBUF}) {
    if (::setsockopt(fd, SOL_SOCKET, opt, &kSocketBuffer, sizeof kSocketBuffer) < 0)
      log().debug("stream={} setsockopt({}): {}", name, opt == SO_SNDBUF ? "SO_SNDBUF" : "SO_RCVBUF",
                  errno_text(errno));
  }
}

std::string failure(const char* what, int err) {
  return std::string(what) + ": " + errno_text(err);
}

}  // namespace

void StreamListener::on_stream_refused(Stream& s, Message&& m, const std::string& reason) {
  log().warn("stream={} message to context {} handle {} not delivered: {}", s.name(),
             m.header.dst_id, m.header.handle, reason);
}

const char* to_string(StreamState s) {
  switch (s) {
    case StreamState::kHandshaking: return "handshaking";
    case StreamState::kOpen: return "open";
    case StreamState::kDraining: return "draining";
    case StreamState::kClosed: return "closed";
  }
  return "?";
}

std::shared_ptr<Stream> Stream::create(Broker& broker, int read_fd, int write_fd,
                                       StreamOptions opts, std::unique_ptr<Handshake> handshake,
                                       StreamListener* listener) {
  return std::shared_ptr<Stream>(
      new Stream(broker, read_fd, write_fd, std::move(opts), std::move(handshake), listener));
}

Stream::Stream(Broker& broker, int read_fd, int write_fd, StreamOptions opts,
               std::unique_ptr<Handshake> handshake, StreamListener* listener)
    : broker_(broker),
      opts_(std::move(opts)),
      listener_(listener),
      rd_(broker.io()),
      handshake_(std::move(handshake)),
      gauge_(std::make_shared<OutputGauge>(opts_.high_water_mark)),
      handshake_timer_(broker.io()) {
  set_nonblocking(read_fd);
  rd_.assign(read_fd);
  if (write_fd != read_fd) {
    set_nonblocking(write_fd);
    wr_.emplace(broker.io());
    wr_->assign(write_fd);
  }
  is_socket_ = fd_is_socket(write_fd);
  if (is_socket_) enlarge_socket_buffers(write_fd, opts_.name);
  had_handshake_ = handshake_ != nullptr;
  // fds travel only over one socket carrying both directions.
  if (handshake_ && is_socket_ && write_fd == read_fd) handshake_->offer_flags(kFlagFdPassing);
}

bool Stream::peer_takes_fds() const {
  if (!is_socket_ || wr_) return false;
  return !had_handshake_ || (peer_.flags & kFlagFdPassing) != 0;
}

Stream::~Stream() {
  std::error_code ignored;
  rd_.close(ignored);
  if (wr_) wr_->close(ignored);
}

void Stream::start() {
  if (handshake_) {
    queue_raw(handshake_->greeting());
    handshake_timer_.expires_after(opts_.handshake_timeout);
    handshake_timer_.async_wait([self = shared_from_this()](const std::error_code& ec) {
      if (ec == asio::error::operation_aborted) return;
      if (self->state_ == StreamState::kHandshaking)
        self->close("handshake timed out after " +
                    std::to_string(self->opts_.handshake_timeout.count()) + " ms");
    });
    flush();
  } else {
    state_ = StreamState::kOpen;
    parser_.emplace(rx_, opts_.max_message_size);
  }
  arm_read();
}

// Waits for readability, then reads. async_wait costs an epoll_ctl(MOD), so
// it is used only when the last read came up short (the socket is probably
// empty); after a full read the next read is posted instead.
void Stream::arm_read() {
  if (read_armed_ || state_ == StreamState::kClosed || eof_seen_ || close_after_flush_) return;
  read_armed_ = true;
  rd_.async_wait(asio::posix::descriptor_base::wait_read,
                 [self = shared_from_this()](const std::error_code& ec) {
                   self->read_armed_ = false;
                   if (ec == asio::error::operation_aborted || self->state_ == StreamState::kClosed)
                     return;
                   if (ec) return self->close(failure("wait for input", ec.value()));
                   self->do_read();
                 });
}

void Stream::do_read() {
  if (state_ == StreamState::kClosed || eof_seen_ || close_after_flush_) return;
  std::span<std::uint8_t> target = parser_ ? parser_->read_target() : rx_.write_space();
  ssize_t n;
  do {
    n = read_once(target);
  } while (n < 0 && errno == EINTR);
  if (n < 0) {
    int err = errno;
    if (err == EAGAIN || err == EWOULDBLOCK) return arm_read();
    if (err == ECONNRESET) return close("connection reset by peer");
    return close(failure("read", err));
  }
  if (n == 0) return on_eof();
  on_read(static_cast<std::size_t>(n), static_cast<std::size_t>(n) == target.size());
}

void Stream::arm_write() {
  if (write_armed_ || state_ == StreamState::kClosed) return;
  write_armed_ = true;
  writer().async_wait(asio::posix::descriptor_base::wait_write,
                      [self = shared_from_this()](const std::error_code& ec) {
                        self->write_armed_ = false;
                        if (ec == asio::error::operation_aborted ||
                            self->state_ == StreamState::kClosed)
                          return;
                        if (ec) return self->close(failure("wait for output", ec.value()));
                        self->flush();
                      });
}

void Stream::on_read(std::size_t n, bool filled) {
  if (parser_) parser_->commit(n);
  else rx_.commit(n);
  stats_.bytes_in += n;
  process_input();
  if (!filled) return arm_read();
  if (read_armed_ || state_ == StreamState::kClosed || eof_seen_ || close_after_flush_) return;
  // One read per turn keeps the broker fair between streams: the next read
  // queues behind the other ready handlers.
  read_armed_ = true;
  asio::post(broker_.io(), [self = shared_from_this()] {
    self->read_armed_ = false;
    self->do_read();
  });
}

bool Stream::run_handshake() {
  std::vector<std::uint8_t> reply;
  HandshakeResult r = handshake_->consume(rx_, reply);
  if (!reply.empty()) queue_raw(std::move(reply));
  if (r.status == HandshakeStatus::kNeedMore) return true;
  if (r.status == HandshakeStatus::kInvalid) {
    log().warn("stream={} handshake failed: {}", name(), r.error);
    close_reason_ = "handshake failed: " + r.error;
    close_after_flush_ = true;
    flush();
    if (state_ != StreamState::kClosed && txq_.empty()) close(close_reason_);
    return false;
  }
  peer_ = handshake_->peer();
  handshake_.reset();
  handshake_timer_.cancel();
  state_ = drain_started_here_ ? StreamState::kDraining : StreamState::kOpen;
  parser_.emplace(rx_, opts_.max_message_size);
  // Framed only now: whether fds may go depends on what the peer announced.
  std::deque<HeldMessage> held;
  held.swap(held_);
  for (HeldMessage& h : held) push_frame(std::move(h.msg), h.charged);
  flush();
  listener_->on_stream_open(*this);
  return state_ != StreamState::kClosed;
}

void Stream::process_input() {
  if (state_ == StreamState::kHandshaking && !run_handshake()) return;
  if (!parser_) return;
  while (state_ != StreamState::kClosed) {
    Message m;
    ParseResult r = parser_->next(m);
    if (r.status == ParseStatus::kNeedMore) {
      if (orphan_fds()) {
        ParseResult bad;
        bad.status = ParseStatus::kInvalid;
        bad.error = fmt::format("{} batch(es) of fds arrived without an SF frame to carry them",
                                rx_fds_.size());
        protocol_error(bad);
      }
      break;
    }
    if (r.status == ParseStatus::kInvalid) {
      protocol_error(r);
      break;
    }
    if (m.header.enc == kEncFds && !bind_fds(m)) continue;
    ++stats_.messages_in;
    listener_->on_stream_message(*this, std::move(m));
  }
  // Always, even after a close: the listener may have corked other streams.
  listener_->on_stream_batch_end(*this);
}

void Stream::protocol_error(const ParseResult& r) {
  log().warn("stream={} protocol error: {}; disconnecting", name(), r.error);
  listener_->on_stream_invalid(*this, r);
  close_reason_ = "protocol error: " + r.error;
  close_after_flush_ = true;
  flush();
  if (state_ != StreamState::kClosed && txq_.empty()) close(close_reason_);
}

void Stream::on_eof() {
  eof_seen_ = true;
  if (state_ == StreamState::kHandshaking) return close("peer closed during handshake");
  if (parser_ && parser_->buffered() > 0)
    return close("peer closed mid-message (" + std::to_string(parser_->buffered()) +
                 " bytes of a partial frame)");
  if (state_ == StreamState::kOpen) state_ = StreamState::kDraining;
  // Answer the goodbye: flush, then half-close; closing follows from flush().
  flush();
  if (state_ != StreamState::kClosed && txq_.empty()) {
    half_close();
    close("peer closed the connection");
  }
}

void Stream::queue_raw(std::vector<std::uint8_t> bytes) {
  if (bytes.empty()) return;
  OutFrame f;
  f.has_header = false;
  f.payload = Payload::copy_of(std::span<const std::uint8_t>(bytes));
  txq_.push_back(std::move(f));
}

void Stream::enqueue(Message&& m, std::size_t charged) {
  if (state_ == StreamState::kHandshaking) {
    held_.push_back(HeldMessage{std::move(m), charged});
    return;
  }
  push_frame(std::move(m), charged);
}

// Builds the iovecs for the next write from the unsent bytes of the queue.
// Small frames are copied into one staging buffer, so a burst of tiny
// messages is one segment for the kernel instead of two per frame; a large
// payload is pointed at where it lies, never copied.
int Stream::gather(iovec* iov, std::size_t& want) {
  staging_.clear();
  if (staging_.capacity() < kStagingSize) staging_.reserve(kStagingSize);
  int cnt = 0;
  auto add = [&](const std::uint8_t* p, std::size_t len, bool stage) {
    if (len == 0) return;
    want += len;
    if (stage) {
      std::uint8_t* dst = staging_.data() + staging_.size();
      bool extends = cnt > 0 && static_cast<std::uint8_t*>(iov[cnt - 1].iov_base) +
                                        iov[cnt - 1].iov_len == dst;
      staging_.insert(staging_.end(), p, p + len);
      if (extends) iov[cnt - 1].iov_len += len;
      else iov[cnt++] = {dst, len};
    } else {
      iov[cnt++] = {const_cast<std::uint8_t*>(p), len};
    }
  };
  for (const OutFrame& f : txq_) {
    // An SF frame's fds go with its first byte, one such frame per sendmsg:
    // it starts a write of its own.
    if (!f.wire_fds.empty() && !f.fds_sent && cnt > 0) break;
    std::size_t left = f.size() - f.sent;
    bool stage = left <= kSmallFrame && staging_.size() + left <= kStagingSize;
    // A frame that would not fit whole waits for the next write, unless it is
    // first: then it goes out in parts (a payload may have > IOV_MAX slices).
    if (!stage && cnt > 0 && cnt + 2 + static_cast<int>(f.payload.slices().size()) > kMaxIov) break;
    std::size_t skip = f.sent;
    if (f.has_header) {
      if (skip < kHeaderSize) add(f.header.data() + skip, kHeaderSize - skip, stage);
      skip = skip > kHeaderSize ? skip - kHeaderSize : 0;
    }
    for (const Slice& sl : f.payload.slices()) {
      if (cnt == kMaxIov) break;
      if (skip >= sl.size) {
        skip -= sl.size;
        continue;
      }
      add(sl.data + skip, sl.size - skip, stage);
      skip = 0;
    }
    if (cnt >= kMaxIov - 1 || (stage && staging_.size() == kStagingSize)) break;
    // Stop before a second SF frame (checked at the top of the next round).
  }
  return cnt;
}

void Stream::flush() {
  if (write_armed_ || state_ == StreamState::kClosed || write_shut_) return;
  const int fd = writer().native_handle();
  while (!txq_.empty()) {
    iovec iov[kMaxIov];
    std::size_t want = 0;
    int cnt = gather(iov, want);
    ssize_t n;
    OutFrame& first = txq_.front();
    const bool with_fds = !first.wire_fds.empty() && !first.fds_sent;
    if (is_socket_) {
      msghdr mh{};
      mh.msg_iov = iov;
      mh.msg_iovlen = static_cast<std::size_t>(cnt);
      alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage)];
      if (with_fds) {
        const std::size_t bytes = sizeof(int) * first.wire_fds.size();
        mh.msg_control = control;
        mh.msg_controllen = CMSG_SPACE(bytes);
        cmsghdr* c = CMSG_FIRSTHDR(&mh);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(bytes);
        std::memcpy(CMSG_DATA(c), first.wire_fds.data(), bytes);
      }
      n = ::sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    } else {
      n = ::writev(fd, iov, cnt);
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return arm_write();
      int err = errno;
      if (with_fds && send_fd_frame_failed(err)) continue;
      if (err == EPIPE && !is_socket_) consume_pending_sigpipe();
      if (err == EPIPE || err == ECONNRESET) return close("peer closed the connection (" + std::string(errno_text(err)) + ")");
      return close(failure("write", err));
    }
    ++stats_.writes;
    stats_.bytes_out += static_cast<std::uint64_t>(n);
    if (with_fds) {
      // The kernel holds its own references now; ours may close.
      first.fds_sent = true;
      stats_.fds_out += first.wire_fds.size();
      first.fds_hold = {};
      first.body_hold.reset();
      if (first.original) {
        first.original->fds = {};
        first.original->sealed_body.reset();
      }
    }
    advance(static_cast<std::size_t>(n));
    if (static_cast<std::size_t>(n) < want) return arm_write();
  }
  if (close_after_flush_) return close(close_reason_);
  if (state_ == StreamState::kDraining) {
    half_close();
    if (eof_seen_) close(drain_started_here_ ? "drained" : "peer closed the connection");
  }
}

void Stream::advance(std::size_t n) {
  std::size_t released = 0;  // one gauge update per write, not per frame
  while (n > 0) {
    OutFrame& f = txq_.front();
    std::size_t left = f.size() - f.sent;
    if (n < left) {
      f.sent += n;
      break;
    }
    n -= left;
    released += f.charged;
    if (f.has_header) ++stats_.messages_out;
    txq_.pop_front();
  }
  if (released) gauge_->release(released);
}

void Stream::drain() {
  if (state_ == StreamState::kClosed || state_ == StreamState::kDraining) return;
  drain_started_here_ = true;
  // A handshake in progress finishes first (the broker's grace deadline bounds
  // it), so what was queued behind it is still delivered.
  if (state_ == StreamState::kHandshaking) return;
  state_ = StreamState::kDraining;
  flush();
}

void Stream::half_close() {
  if (write_shut_ || state_ == StreamState::kClosed) return;
  write_shut_ = true;
  if (is_socket_ && !wr_) {
    if (::shutdown(rd_.native_handle(), SHUT_WR) < 0 && errno != ENOTCONN)
      log().debug("stream={} shutdown(SHUT_WR): {}", name(), errno_text(errno));
  } else if (wr_) {
    std::error_code ignored;
    wr_->close(ignored);
  }
}

void Stream::close(const std::string& reason) {
  if (state_ == StreamState::kClosed) return;
  state_ = StreamState::kClosed;
  std::error_code ignored;
  handshake_timer_.cancel();
  rd_.close(ignored);
  if (wr_) wr_->close(ignored);
  std::vector<Message> unsent;
  for (OutFrame& f : txq_) {
    if (f.charged) gauge_->release(f.charged);
    // A partly written frame never reached the peer whole (its parser drops a
    // partial frame at EOF): it is as undelivered as the rest.
    if (!f.has_header) continue;
    if (f.original) unsent.push_back(std::move(*f.original));
    else unsent.push_back(Message{decode_header(f.header.data()), std::move(f.payload)});
  }
  txq_.clear();
  for (HeldMessage& h : held_) {
    if (h.charged) gauge_->release(h.charged);
    unsent.push_back(std::move(h.msg));
  }
  held_.clear();
  rx_fds_.clear();
  gauge_->close();
  log().debug("stream={} closed: {}", name(), reason);
  listener_->on_stream_closed(*this, reason, std::move(unsent));
}

}  // namespace spindle
