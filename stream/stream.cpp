// Reads: the stream's own non-blocking recvmsg() (read() on a pipe) straight
// into the parser's read target (a receive chunk or a large message's own
// body buffer), one read per broker turn so one busy peer cannot starve the
// others. recvmsg rather than Asio's async_read_some because fds arrive as
// ancillary data (MSG_CMSG_CLOEXEC, MSG_CTRUNC checked on every call). A turn
// also delivers a bounded number of frames (a share of a chunk among the
// busy streams, broker/input_turns.h): the rest wait in the chunk for the
// stream's next turn, so the wait of a stream that has just become readable
// stays short however many peers flood. After a read that
// filled its target or ended at a message with fds (the kernel stops there),
// or with frames left, the next turn is posted; after another short read the
// stream waits for readability. Before each
// read the peer's account is checked: over its limit, the stream stops
// reading until a release brings it back under (Account::on_relief; the
// limits and holds are in stream_limits.cpp).
// A listener may throw through a turn (a handler's policy does; the broker
// loop logs it): the batch still ends (its corked output is flushed), the
// frame that threw is consumed, and the next turn is queued before the
// exception goes on, so the stream keeps reading.
//
// Writes (queueing, flushing, draining) are in stream_tx.cpp; the fd steps
// (receiving and binding fds, framing SF frames and refusing) in
// stream_fds.cpp.
#include "stream/stream.h"

#include <fcntl.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <system_error>
#include <thread>

#include <asio/post.hpp>
#include <fmt/format.h>

#include "broker/errors.h"
#include "broker/log.h"
#include "broker/summary_log.h"
#include "stream/fd_control.h"

namespace spindle {
namespace {

// Reads in one turn while each ends at a message with fds, and the fds those
// reads may bring in (a bound on what one turn makes this process hold).
constexpr std::size_t kReadsAfterFds = 16;
constexpr std::size_t kFdsPerTurn = 64;

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

// Resumes a paused reader from whichever thread released the charge that
// brought its account back under the limit. It posts to the broker only while
// the stream lives: the stream clears `broker` under the mutex as it dies, so
// a payload released long after never touches a broker that is gone.
struct ReadResumer {
  std::mutex mu;
  Broker* broker = nullptr;
  std::weak_ptr<Stream> stream;
  void fire();
};

void StreamListener::on_stream_frame(Stream& s, InFrame& f) { on_stream_message(s, f.take()); }

void StreamListener::on_stream_refused(Stream& s, Message&& m, Refused, const std::string& reason) {
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
  std::shared_ptr<Stream> s;
  try {
    s.reset(new Stream(broker, read_fd, write_fd, std::move(opts), std::move(handshake), listener));
  } catch (...) {
    // The constructor adopts no fd until nothing else can throw: they are
    // still ours to close.
    ::close(read_fd);
    if (write_fd != read_fd) ::close(write_fd);
    throw;
  }
  s->wire_up();
  return s;
}

Stream::Stream(Broker& broker, int read_fd, int write_fd, StreamOptions opts,
               std::unique_ptr<Handshake> handshake, StreamListener* listener)
    : broker_(broker),
      opts_(std::move(opts)),
      listener_(listener),
      rd_(broker.io()),
      handshake_(std::move(handshake)),
      account_(std::make_shared<Account>(opts_.memory_limit, opts_.budget, opts_.uid)),
      port_(std::make_shared<StreamPort>(opts_.high_water_mark, opts_.uid.value_or(process_uid()))),
      tx_(account_.get()),
      handshake_timer_(broker.io()),
      stall_timer_(broker.io()),
      hold_timer_(broker.io()),
      body_timer_(broker.io()),
      partial_timer_(broker.io()),
      fds_timer_(broker.io()),
      resumer_(std::make_shared<ReadResumer>()) {
  set_nonblocking(read_fd);
  if (write_fd != read_fd) set_nonblocking(write_fd);
  is_socket_ = fd_is_socket(write_fd);
  if (write_fd != read_fd) wr_.emplace(broker.io());
  // From here on nothing throws before both fds are adopted.
  std::error_code ec;
  rd_.assign(read_fd, ec);
  if (ec) throw std::system_error(ec, "adopting the stream's fd");
  if (wr_) {
    wr_->assign(write_fd, ec);
    if (ec) {
      rd_.release();  // create() closes both
      throw std::system_error(ec, "adopting the stream's write fd");
    }
  }
  if (is_socket_) enlarge_socket_buffers(write_fd, opts_.name);
  had_handshake_ = handshake_ != nullptr;
  // fds travel only over one socket carrying both directions.
  if (handshake_ && is_socket_ && write_fd == read_fd) {
    handshake_->offer_flags(kFlagFdPassing | kFlagFdBatches | kFlagMemfdRanges);
    accept_fd_extensions_ = true;
  }
  rx_.set_account(account_);
  port_->fd = write_fd;
  port_->is_socket = is_socket_ && !wr_;
  port_->peer_takes_fds.store(port_->is_socket, std::memory_order_release);
  port_->name = opts_.name;
}

// Callbacks that need a weak_ptr to this stream: set once it is owned.
void Stream::wire_up() {
  std::weak_ptr<Stream> weak = weak_from_this();
  resumer_->broker = &broker_;
  resumer_->stream = weak;
  account_->on_relief([r = resumer_] { r->fire(); });
  Broker* broker = &broker_;
  std::shared_ptr<StreamPort> port = port_;
  port_->hand_over = [weak, broker, resumer = resumer_, port = port.get()](TxFrame* rest,
                                                                           const std::string& error) {
    auto frame = rest ? std::make_shared<TxFrame>(std::move(*rest)) : nullptr;
    bool posted = false;
    {
      std::lock_guard lk(resumer->mu);
      if (resumer->broker)
        posted = broker->try_post([weak, frame, error] {
          if (auto s = weak.lock()) s->take_over(frame.get(), error);
        });
    }
    // The broker is gone: nobody will take the frame; give the fd back so
    // the stream's end never waits for it.
    if (!posted && frame) port->gate.clear_rest();
  };
}

void ReadResumer::fire() {
  std::lock_guard lk(mu);
  if (!broker) return;
  broker->try_post([w = stream] {
    if (auto s = w.lock()) s->resume_reading();
  });
}

bool Stream::peer_takes_fds() const {
  if (!is_socket_ || wr_) return false;
  return !had_handshake_ || (peer_.flags & kFlagFdPassing) != 0;
}

bool Stream::peer_takes_fd_batches() const {
  return had_handshake_ && peer_takes_fds() && (peer_.flags & kFlagFdBatches) != 0;
}

bool Stream::peer_takes_memfd_ranges() const {
  return had_handshake_ && peer_takes_fds() && (peer_.flags & kFlagMemfdRanges) != 0;
}

void Stream::set_name(std::string name) {
  opts_.name = std::move(name);
  port_->name = opts_.name;  // read only by the broker thread's own logs
}

Stream::~Stream() {
  {
    std::lock_guard lk(resumer_->mu);
    resumer_->broker = nullptr;
  }
  // An application thread may be in the middle of a direct write: the fd must
  // stay open (its number not reused) until it lets go.
  port_->gate.close();
  while (port_->gate.load() & TxGate::kUser) std::this_thread::yield();
  close_fds();
}

void Stream::close_fds() {
  if (fds_closed_) return;
  fds_closed_ = true;
  // The link ends for every process that holds a copy of the socket, not
  // only for this one: a process forked while the link was open (an
  // os.fork() or multiprocessing child keeps its parent's Spindle objects
  // abandoned, fds and all) would otherwise keep the peer from hearing our
  // EOF until it exited. Closing without a half-close happens whenever a
  // stream ends before its goodbye (an error, the grace deadline, or the
  // peer's EOF while an application thread was writing directly), and a
  // child that stopped in that window waited out its whole grace period.
  if (is_socket_ && !wr_ && rd_.is_open() && ::shutdown(rd_.native_handle(), SHUT_RDWR) < 0 &&
      errno != ENOTCONN)
    log().debug("stream={} shutdown(SHUT_RDWR): {}", name(), errno_text(errno));
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
    make_parser();
    if (port_->is_socket) port_->gate.allow_direct();
    flush();
  }
  arm_read();
}

// Waits for readability, then reads. async_wait costs an epoll_ctl(MOD), so
// it is used only when the last read came up short (the socket is probably
// empty); after a full read the next read is posted instead.
void Stream::arm_read() {
  // While it waits, a connection holds no receive chunk: an idle one gives it
  // back, and one that waits for the rest of a frame keeps only that frame's
  // bytes, charged (RxBuffer::let_go). Not while reading is paused: the
  // charge could keep it over its limit, and nothing but the next read would
  // release it. do_read() takes the bytes back before it looks at the limit.
  const bool waits = !read_armed_ && may_read() && !over_limit();
  rx_.let_go(waits);
  if (!waits) return;
  if (peer_exited_) {  // nothing more can come: end now, or read what is left first
    if (input_drained()) return close(std::string(*peer_exited_));
    return queue_input_turn();
  }
  read_armed_ = waiting_input_ = true;
  ++stats_.read_waits;
  rd_.async_wait(asio::posix::descriptor_base::wait_read,
                 [self = shared_from_this()](const std::error_code& ec) {
                   self->read_armed_ = self->waiting_input_ = false;
                   if (ec == asio::error::operation_aborted || self->state_ == StreamState::kClosed)
                     return;
                   self->broker_.check_loop_thread();
                   if (ec) return self->close(failure("wait for input", ec.value()));
                   self->do_read();
                 });
}

void Stream::do_read() {
  if (!may_read()) return;
  rx_.unstash();  // its charge must not count against the read that completes its frame
  if (over_limit()) return;
  // The kernel ends a read at each message that carries fds. Up to
  // kReadsAfterFds more reads follow in this turn while reads keep ending
  // there (and the fds they brought stay few), so a peer that passes an fd
  // with every frame costs a recvmsg per frame, not also a turn and an
  // epoll_wait each. The frames are then parsed together.
  ++stats_.read_turns;
  std::size_t got = 0, fds_before = stats_.fds_in;
  bool more = false;  // the socket probably holds more
  for (std::size_t reads = 0;; ++reads) {
    std::span<std::uint8_t> target = parser_ ? parser_->read_target() : rx_.write_space();
    ssize_t n;
    bool at_fds;
    do {
      n = read_once(target, at_fds);
    } while (n < 0 && errno == EINTR);
    if (n < 0) {
      int err = errno;
      if (err == EAGAIN || err == EWOULDBLOCK) {
        if (got > 0) break;
        return arm_read();
      }
      if (err == ECONNRESET) return close("connection reset by peer");
      return close(failure("read", err));
    }
    if (n == 0) {
      if (got == 0) return on_eof();
      more = true;  // the next turn's read sees the EOF, after these frames
      break;
    }
    commit_read(static_cast<std::size_t>(n));
    got += static_cast<std::size_t>(n);
    // A read that filled its target, or ended at a message with fds, is
    // followed by another read rather than a wait for readability
    // (async_wait costs an epoll_ctl, and the wait an epoll_wait).
    const bool filled = static_cast<std::size_t>(n) == target.size();
    more = filled || at_fds;
    if (filled || !at_fds || !parser_ || reads + 1 >= kReadsAfterFds ||
        stats_.fds_in - fds_before >= kFdsPerTurn)
      break;
  }
  on_read(more);
}

void Stream::arm_write() {
  if (write_armed_ || state_ == StreamState::kClosed) return;
  write_armed_ = true;
  // The socket is full: a client that leaves a queue over its mark untaken
  // for the stall timeout is dropped (its senders get dead replies).
  if (stalled()) arm_stall_timer();
  writer().async_wait(asio::posix::descriptor_base::wait_write,
                      [self = shared_from_this()](const std::error_code& ec) {
                        self->write_armed_ = false;
                        if (ec == asio::error::operation_aborted ||
                            self->state_ == StreamState::kClosed)
                          return;
                        self->broker_.check_loop_thread();
                        if (ec) return self->close(failure("wait for output", ec.value()));
                        self->flush();
                      });
}

void Stream::commit_read(std::size_t n) {
  if (parser_) parser_->commit(n);
  else rx_.commit(n);
  stats_.bytes_in += n;
}

void Stream::on_read(bool filled) {
  // The peer spoke: an application thread may write the next request itself.
  if (state_ == StreamState::kOpen && port_->is_socket) port_->gate.allow_direct();
  last_read_filled_ = filled;
  try {
    input_left_ = process_input();
  } catch (...) {
    // A listener threw through the batch (a handler's policy may; the
    // exception is for the broker loop to log). The batch has ended (Batch
    // is RAII: corked output is flushed) and the frame that threw is
    // consumed. The next turn is taken as if frames were left, so the stream
    // goes on reading, starting with the frames behind the one that threw:
    // without it nothing re-armed the read and the peer went unheard.
    input_left_ = true;
    queue_input_turn();
    throw;
  }
  if (!input_left_ && !filled) return arm_read();
  queue_input_turn();
}

// One turn per busy stream keeps the broker fair between streams: the next
// turn (frames left over, or the next read) queues behind the other busy
// streams' (broker/input_turns.h, which polls epoll between bounded chunks).
void Stream::queue_input_turn() {
  if (read_armed_ || paused_ || !may_read()) return;  // paused: resume_reading() queues it
  read_armed_ = true;
  broker_.input_turns().push(shared_from_this());
}

std::size_t Stream::run_input_turn() {
  broker_.check_loop_thread();
  read_armed_ = false;
  const std::uint64_t before = stats_.messages_in;
  input_turn();
  return static_cast<std::size_t>(stats_.messages_in - before);
}

void Stream::input_turn() {
  if (state_ == StreamState::kClosed) return;
  if (!input_left_) return do_read();
  try {
    input_left_ = process_input();
  } catch (...) {  // as in on_read()
    input_left_ = true;
    queue_input_turn();
    throw;
  }
  if (!input_left_ && !last_read_filled_) return arm_read();
  queue_input_turn();
}

bool Stream::run_handshake() {
  std::vector<std::uint8_t> reply;
  HandshakeResult r = handshake_->consume(rx_, reply);
  if (!reply.empty()) queue_raw(reply);
  if (r.status == HandshakeStatus::kNeedMore) {
    // Every byte received so far belongs to the handshake, and fds arrive
    // with the first byte of their send: these came with it, which no peer
    // does (a frame with fds may follow its hello at once, never ride in
    // it). Held until the handshake ended, they would let a client that
    // never finishes its hello pin hundreds of this process's fds.
    if (!rx_fds_.empty()) return fail_handshake("fds arrived before the handshake completed");
    return true;
  }
  if (r.status == HandshakeStatus::kInvalid) return fail_handshake(r.error);
  peer_ = handshake_->peer();
  port_->peer_takes_fds.store(peer_takes_fds(), std::memory_order_release);
  port_->max_message_size.store(max_message_size(), std::memory_order_release);
  handshake_.reset();
  handshake_timer_.cancel();
  state_ = drain_started_here_ ? StreamState::kDraining : StreamState::kOpen;
  make_parser();
  // Framed only now: whether fds may go depends on what the peer announced.
  std::deque<HeldMessage> held;
  held.swap(held_);
  for (HeldMessage& h : held) push_frame(std::move(h.msg), h.charged);
  if (state_ == StreamState::kOpen && port_->is_socket) port_->gate.allow_direct();
  else port_->gate.close();
  flush();
  listener_->on_stream_open(*this);
  return state_ != StreamState::kClosed;
}

bool Stream::fail_handshake(const std::string& error) {
  // A client can fail handshakes as fast as it connects: summed up.
  static SummaryLog failed(spdlog::level::warn);
  failed.note([&] { return fmt::format("stream={} handshake failed: {}", name(), error); });
  rx_fds_.clear();
  close_reason_ = "handshake failed: " + error;
  close_after_flush_ = true;
  flush();
  if (state_ != StreamState::kClosed && tx_.empty()) close(close_reason_);
  return false;
}

bool Stream::process_input() {
  if (state_ == StreamState::kHandshaking && !run_handshake()) return false;
  if (!parser_) return false;
  std::size_t budget = broker_.input_turns().frames_per_turn();
  // The batch ends however the loop ends (a handler may throw through it):
  // the listener flushes what it corked, always. `f` outlives the batch,
  // whose end consumes the frame last handed out.
  InFrame f;
  struct Batch {
    Stream& s;
    explicit Batch(Stream& st) : s(st) { s.listener_->on_stream_batch_begin(s); }
    ~Batch() {
      s.parser_->finish();
      s.listener_->on_stream_batch_end(s);
    }
  } batch(*this);
  while (state_ != StreamState::kClosed) {
    if (input_stopped()) return true;  // what is left waits for the hold's end
    if (budget-- == 0) return true;
    // An untrusted peer is paused at the frame that put it over, not at the
    // next read: a 128 KiB read holds some 3,000 small calls, each of which
    // can cost an answer far larger than itself (Router::kCallInFlightBytes).
    // What is left waits in the buffer for resume_reading().
    if (opts_.untrusted && account_->over() && over_limit()) return true;
    ParseResult r = parser_->next(f);
    if (r.status == ParseStatus::kNeedMore) {
      if (r.memory_wait) wait_for_memory(r.header.length);
      watch_body();
      watch_partial();
      watch_fds();
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
    ++stats_.messages_in;
    deliver(f);
  }
  return false;
}

void Stream::deliver(InFrame& f) {
  if (f.header.enc != kEncFds) return listener_->on_stream_frame(*this, f);
  Message m = f.take();
  if (bind_fds(m)) listener_->on_stream_message(*this, std::move(m));
}

void Stream::protocol_error(const ParseResult& r) {
  // One line a connection would let a client that connects, sends garbage
  // and reconnects write the log at its own rate: summed up past a burst.
  static SummaryLog protocol_errors(spdlog::level::warn, 20);
  protocol_errors.note(
      [&] { return fmt::format("stream={} protocol error: {}; disconnecting", name(), r.error); });
  listener_->on_stream_invalid(*this, r);
  close_reason_ = "protocol error: " + r.error;
  close_after_flush_ = true;
  flush();
  if (state_ != StreamState::kClosed && tx_.empty()) close(close_reason_);
}

void Stream::peer_exited(const std::string& reason) {
  if (state_ == StreamState::kClosed || eof_seen_ || peer_exited_) return;
  peer_exited_ = reason;
  // A stream waiting for input with none left would wait forever. One with
  // input left, a turn queued, or reading paused comes back to arm_read().
  if (waiting_input_ && input_drained()) close(reason);
}

bool Stream::input_drained() {
  int n = 0;
  if (::ioctl(rd_.native_handle(), FIONREAD, &n) < 0) {
    log().debug("stream={} FIONREAD: {}", name(), errno_text(errno));
    return true;  // cannot tell: ending is better than waiting forever
  }
  return n == 0;
}

void Stream::on_eof() {
  eof_seen_ = true;
  if (state_ == StreamState::kHandshaking) return close("peer closed during handshake");
  if (parser_ && parser_->partial())
    return close("peer closed mid-message (" + std::to_string(parser_->partial_bytes()) +
                 " bytes of a partial frame)");
  if (state_ == StreamState::kOpen) state_ = StreamState::kDraining;
  port_->gate.close();
  // Answer the goodbye: flush, then half-close; closing follows from flush().
  flush();
  if (state_ != StreamState::kClosed && tx_.empty() && !write_armed_) {
    half_close();
    close("peer closed the connection");
  }
}

void Stream::close(const std::string& reason) {
  if (state_ == StreamState::kClosed) return;
  state_ = StreamState::kClosed;
  handshake_timer_.cancel();
  stall_timer_.cancel();
  hold_timer_.cancel();
  body_timer_.cancel();
  partial_timer_.cancel();
  fds_timer_.cancel();
  std::error_code ignored;
  rd_.cancel(ignored);
  if (wr_) wr_->cancel(ignored);
  // An application thread writing right now keeps the fd until its kick.
  if (!port_->gate.close()) close_fds();
  const std::size_t queued = tx_.queued_bytes();
  Unsent unsent = tx_.clear();
  busy_ = false;
  if (queued) port_->gauge.release(queued);
  for (HeldMessage& h : held_) {
    if (h.charged) port_->gauge.release(h.charged);
    if (h.msg.is_dead()) {
      ++unsent.dead;
    } else if (h.msg.header.reply_to != 0) {
      unsent.wanting_reply.push_back(h.msg.header);
    } else {
      if (unsent.other_headers.size() < Unsent::kOtherKept) unsent.other_headers.push_back(h.msg.header);
      ++unsent.other;
    }
  }
  held_.clear();
  rx_fds_.clear();
  port_->gauge.close();
  log().debug("stream={} closed: {}", name(), reason);
  listener_->on_stream_closed(*this, reason, std::move(unsent));
}

}  // namespace spindle
