// Reads: the stream's own non-blocking recvmsg() (read() on a pipe) straight
// into the parser's read target (a receive chunk or a large message's own
// body buffer), one read per broker turn so one busy peer cannot starve the
// others. recvmsg rather than Asio's async_read_some because fds arrive as
// ancillary data (MSG_CMSG_CLOEXEC, MSG_CTRUNC checked on every call). After
// a read that filled its target the next one is posted (more is likely
// waiting); after a short read the stream waits for readability. Writes: the
// stream does its own non-blocking writev()/sendmsg() of many frames and
// waits for writability only when the socket is full; an SF frame starts its
// own sendmsg and carries its fds as SCM_RIGHTS.
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
#include "shm/memfd.h"
#include "stream/fd_frame.h"

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

ssize_t Stream::read_once(std::span<std::uint8_t> target) {
  const int fd = rd_.native_handle();
  if (!is_socket_) return ::read(fd, target.data(), target.size());
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage)];
  iovec iov{target.data(), target.size()};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  mh.msg_control = control;
  mh.msg_controllen = sizeof control;
  ssize_t n = ::recvmsg(fd, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
  if (n < 0) return n;
  FdBatch batch;
  for (cmsghdr* c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    const unsigned char* p = CMSG_DATA(c);
    for (std::size_t i = 0; i < count; ++i) {
      int fd_in;
      std::memcpy(&fd_in, p + i * sizeof(int), sizeof(int));
      batch.fds.emplace_back(fd_in);
    }
  }
  // MSG_CTRUNC: the kernel dropped fds (this process is at RLIMIT_NOFILE, or
  // more arrived than fit). Never ignored: the frame they belong to fails.
  batch.truncated = (mh.msg_flags & MSG_CTRUNC) != 0;
  if (!batch.fds.empty() || batch.truncated) {
    stats_.fds_in += batch.fds.size();
    rx_fds_.push_back(std::move(batch));
  }
  return n;
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

// Every complete frame has been parsed: a batch still waiting must belong to
// the one partial frame left (its first byte came with the fds). More than
// one, or one with nothing buffered, came with frames that were not SF: a
// peer could otherwise pile fds up in this process.
bool Stream::orphan_fds() const {
  return rx_fds_.size() > 1 || (rx_fds_.size() == 1 && parser_->buffered() == 0);
}

void Stream::protocol_error(const ParseResult& r) {
  log().warn("stream={} protocol error: {}; disconnecting", name(), r.error);
  listener_->on_stream_invalid(*this, r);
  close_reason_ = "protocol error: " + r.error;
  close_after_flush_ = true;
  flush();
  if (state_ != StreamState::kClosed && txq_.empty()) close(close_reason_);
}

// Gives an SF frame its fds: the oldest batch received. The sender passed
// them with the frame's first byte and one SF frame per sendmsg, and the
// kernel never returns fds later than the byte they came with, so by the time
// a frame is complete its batch is the oldest one not yet taken.
bool Stream::bind_fds(Message& m) {
  ParseResult bad;
  bad.status = ParseStatus::kInvalid;
  bad.header = m.header;
  bad.header_valid = true;
  std::optional<FdPrefix> prefix = decode_fd_prefix(m.data, bad.error);
  if (!prefix) {
    protocol_error(bad);
    return false;
  }
  if (rx_fds_.empty()) {
    bad.error = fmt::format("SF frame declares {} fds but none arrived with it", prefix->fd_count);
    protocol_error(bad);
    return false;
  }
  FdBatch batch = std::move(rx_fds_.front());
  rx_fds_.pop_front();
  m.header.enc = prefix->inner_enc;
  m.data = drop_front(m.data, kFdPrefixSize);
  m.header.length = static_cast<std::uint32_t>(m.data.size());
  if (batch.truncated) {
    // The bytes are intact, only this frame's fds are lost: refuse the
    // message, keep the connection (docs/PROTOCOL.md §13.4).
    const std::size_t arrived = std::min<std::size_t>(batch.fds.size(), prefix->fd_count);
    batch.fds.clear();  // give the slots back before anything else needs one
    std::string why = fmt::format("{}: {} of {} fds lost (MSG_CTRUNC) at context {} on stream {}",
                                  fdreason::kFdsLost, prefix->fd_count - arrived, prefix->fd_count,
                                  peer_.local_id, name());
    log().error("stream={} {}; message from context {} handle {} refused", name(), why,
                m.header.src_id, m.header.handle);
    listener_->on_stream_refused(*this, std::move(m), why);
    return false;
  }
  if (batch.fds.size() != prefix->fd_count) {
    bad.error = fmt::format("SF frame declares {} fds but {} arrived with it", prefix->fd_count,
                            batch.fds.size());
    protocol_error(bad);
    return false;
  }
  if (prefix->memfd_body()) {
    std::string err;
    auto body = SealedMemfd::adopt(std::move(batch.fds.front()), err);
    batch.fds.erase(batch.fds.begin());
    if (body && body->size() > opts_.max_message_size)
      err = fmt::format("message too large: {} bytes exceeds the maximum of {}", body->size(),
                        opts_.max_message_size);
    if (!err.empty()) {
      std::string why = fmt::format("{}: {}", fdreason::kBadMemfd, err);
      log().warn("stream={} {}; message from context {} handle {} refused", name(), why,
                 m.header.src_id, m.header.handle);
      listener_->on_stream_refused(*this, std::move(m), why);
      return false;
    }
    m.sealed_body = std::move(body);
  }
  m.fds = FdSet(std::move(batch.fds));
  return true;
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

void Stream::refuse(Message&& m, std::size_t charged, const std::string& reason) {
  if (charged) gauge_->release(charged);
  m.fds = {};
  m.sealed_body.reset();
  listener_->on_stream_refused(*this, std::move(m), reason);
}

// Frames a message for this peer. fds and a memfd body go in an SF frame if
// the peer takes fds; otherwise a memfd body goes inline (mapped, not
// copied) and fds are refused: they cannot be turned into bytes.
void Stream::push_frame(Message&& m, std::size_t charged) {
  const std::size_t nfds = m.fds.size();
  if (nfds > kMaxFdsPerMessage)
    return refuse(std::move(m), charged,
                  fmt::format("{}: {} exceeds the limit of {} per message", fdreason::kTooManyFds,
                              nfds, kMaxFdsPerMessage));
  const bool fd_peer = peer_takes_fds();
  if (nfds > 0 && !fd_peer)
    return refuse(std::move(m), charged,
                  fmt::format("{}: {} fds for context {} on stream {}", fdreason::kFdsUnsupported,
                              nfds, m.header.dst_id, name()));
  // The body goes as an fd when it is (or sits in) a sealed memfd and a slot
  // is left for it; else inline.
  std::shared_ptr<const SealedMemfd> body = m.sealed_body ? m.sealed_body : m.data.memfd();
  if (body && (!fd_peer || nfds == kMaxFdsPerMessage)) {
    if (m.sealed_body) {
      try {
        m.data = m.sealed_body->map();
      } catch (const std::exception& e) {
        return refuse(std::move(m), charged, fmt::format("{}: {}", fdreason::kBadMemfd, e.what()));
      }
      m.sealed_body.reset();
    }
    body.reset();
  }
  OutFrame f;
  f.charged = charged;
  if (nfds == 0 && !body) {
    m.header.length = static_cast<std::uint32_t>(m.data.size());
    f.header = encode_header(m.header);
    f.payload = std::move(m.data);
    txq_.push_back(std::move(f));
    return;
  }
  FdPrefix prefix{m.header.enc, static_cast<std::uint16_t>(nfds + (body ? 1 : 0)),
                  body ? kFdFlagMemfdBody : std::uint16_t{0}};
  auto prefix_bytes = encode_fd_prefix(prefix);
  f.payload = Payload::copy_of(std::span<const std::uint8_t>(prefix_bytes));
  if (!body)
    for (const Slice& sl : m.data.slices()) f.payload.append(sl);
  Header h = m.header;
  h.enc = kEncFds;
  h.length = static_cast<std::uint32_t>(f.payload.size());
  f.header = encode_header(h);
  if (body) f.wire_fds.push_back(body->fd());
  for (int fd : m.fds.raw()) f.wire_fds.push_back(fd);
  f.fds_hold = m.fds;
  f.body_hold = body;
  f.original = std::make_unique<Message>(std::move(m));
  txq_.push_back(std::move(f));
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

// sendmsg refused the fds of the frame at the head of the queue (nothing of
// it was written): that message fails alone, with the reason, and the rest of
// the queue goes on. Errors that are not about the fds close the stream as
// usual (returns false).
bool Stream::send_fd_frame_failed(int err) {
  if (err != ETOOMANYREFS && err != EMFILE && err != ENFILE && err != EINVAL && err != EBADF)
    return false;
  OutFrame f = std::move(txq_.front());
  txq_.pop_front();
  std::string why = fmt::format("{}: sendmsg: {} ({} fds, stream {})", fdreason::kSendFailed,
                                errno_text(err), f.wire_fds.size(), name());
  log().warn("stream={} {}", name(), why);
  Message m = f.original ? std::move(*f.original) : Message{decode_header(f.header.data()), {}};
  refuse(std::move(m), f.charged, why);
  return true;
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
