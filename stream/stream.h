// Stream: one connection, and the state machine it runs.
//
//   handshaking --(handshake complete)--> open --(drain / peer EOF)--> draining --> closed
//        \____________________(error, timeout, force close)_______________________/
//
// Role: moves bytes between a file descriptor pair and Messages. It reads into
// an RxBuffer of 128 KiB chunks; a Handshake object consumes the first bytes,
// then hands the same buffer to a FrameParser (Mitogen's Stream/Protocol split:
// the protocol changes, the connection stays). It writes queued frames with
// one gathered write (writev/sendmsg of up to IOV_MAX iovecs) and, when the
// queue was empty, writes at once.
//
// Transports: a socketpair or UNIX stream socket (one fd, both directions), or
// a pipe pair such as a child's stdin/stdout (two fds). EOF, ECONNRESET, EPIPE
// and EAGAIN are ordinary events: EAGAIN waits for readiness, the others start
// the close path with a reason.
//
// File descriptors (docs/PROTOCOL.md §13): on a socket whose peer announced
// kFlagFdPassing, a message's fds and a memfd body travel with SCM_RIGHTS in
// an "SF" frame, one such frame per sendmsg, starting at its first byte.
// Reads are recvmsg(MSG_CMSG_CLOEXEC); each batch of fds received is bound to
// the next SF frame parsed. A batch the kernel truncated (MSG_CTRUNC: this
// process is at its fd limit) fails only its own frame: the listener gets
// on_stream_refused() with the reason and the stream stays open, since the
// bytes, and so the framing, arrived intact. A peer without the flag gets a
// memfd body inline; a message with fds for it is refused the same way.
//
// Draining ("say goodbye"): flush the queue, half-close the write side (EOF to
// the peer), keep reading until the peer's EOF, then close. A peer that sends
// EOF first is answered the same way, so both sides deliver everything queued.
//
// Thread safety: broker thread only, except gauge(), which any thread may use.
// Ownership: created with make_shared and held by its owner (the Router);
// pending IO handlers hold a reference too, so a closed stream dies when its
// last handler has run. The listener is borrowed and must outlive the stream's
// open life (it is told on_stream_closed exactly once).
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <sys/types.h>

#include <asio/posix/stream_descriptor.hpp>
#include <asio/steady_timer.hpp>

#include "broker/broker.h"
#include "stream/handshake.h"
#include "stream/output_gauge.h"
#include "stream/parser.h"

struct iovec;

namespace spindle {

class Stream;

enum class StreamState { kHandshaking, kOpen, kDraining, kClosed };
const char* to_string(StreamState s);

class StreamListener {
 public:
  virtual ~StreamListener() = default;
  virtual void on_stream_open(Stream& s) = 0;
  virtual void on_stream_message(Stream& s, Message&& m) = 0;
  // After the messages of one read batch, even if the stream has just closed:
  // the moment to flush output corked while handling them.
  virtual void on_stream_batch_end(Stream& s) = 0;
  // A frame that cannot be parsed; the stream closes right after this call
  // (flushing first, so a dead reply queued here is still sent).
  virtual void on_stream_invalid(Stream& s, const ParseResult& r) = 0;
  // A message that cannot travel with its fds: received without them (the
  // kernel dropped them, MSG_CTRUNC), with a memfd body that is not sealed, or
  // refused on send (the peer cannot take fds, sendmsg failed with
  // ETOOMANYREFS/EMFILE, too many fds). `m` is the message (without the fds),
  // so its sender can be told why; the stream stays open.
  virtual void on_stream_refused(Stream& s, Message&& m, const std::string& reason);
  // Exactly once. `unsent` holds the messages still queued, so their senders
  // can be told they were not delivered.
  virtual void on_stream_closed(Stream& s, const std::string& reason,
                                std::vector<Message> unsent) = 0;
};

struct StreamOptions {
  std::string name = "stream";
  std::uint32_t max_message_size = kDefaultMaxMessageSize;
  std::size_t high_water_mark = kDefaultHighWaterMark;
  std::chrono::milliseconds handshake_timeout{10000};
};

struct StreamStats {
  std::uint64_t bytes_in = 0, bytes_out = 0;
  std::uint64_t messages_in = 0, messages_out = 0;
  std::uint64_t writes = 0;  // write syscalls that moved bytes
  std::uint64_t fds_in = 0, fds_out = 0;
};

class Stream : public std::enable_shared_from_this<Stream> {
 public:
  // Takes ownership of the fds (read_fd == write_fd for a socket). Sets them
  // non-blocking. Throws std::system_error if an fd is unusable.
  static std::shared_ptr<Stream> create(Broker& broker, int read_fd, int write_fd,
                                        StreamOptions opts, std::unique_ptr<Handshake> handshake,
                                        StreamListener* listener);
  ~Stream();

  void start();
  // Queues a message; bytes must already be charged to gauge() (or be
  // charge-free control traffic: pass charged = 0). Does not write.
  void enqueue(Message&& m, std::size_t charged);
  // Writes what is queued unless a write is already waiting for readiness.
  void flush();
  // Graceful: flush, say goodbye, wait for the peer's EOF. While handshaking,
  // the handshake completes first and what was held behind it is sent.
  void drain();
  void close(const std::string& reason);

  StreamState state() const { return state_; }
  bool is_open() const { return state_ == StreamState::kOpen; }
  // Whether enqueue() will still send: messages queued while handshaking are
  // held back and go out right after the handshake.
  bool accepts_output() const {
    return state_ == StreamState::kHandshaking || state_ == StreamState::kOpen ||
           (state_ == StreamState::kDraining && !write_shut_ && !close_after_flush_);
  }
  const std::string& name() const { return opts_.name; }
  void set_name(std::string name) { opts_.name = std::move(name); }
  const PeerInfo& peer() const { return peer_; }
  const StreamStats& stats() const { return stats_; }
  std::size_t queued_frames() const { return txq_.size(); }
  OutputGauge& gauge() { return *gauge_; }
  const std::shared_ptr<OutputGauge>& gauge_ptr() const { return gauge_; }
  std::uint32_t max_message_size() const { return opts_.max_message_size; }
  // Whether fds can travel to the peer: a socket, and the peer announced
  // kFlagFdPassing (a stream without a handshake assumes it on a socket).
  bool peer_takes_fds() const;

 private:
  struct OutFrame {
    HeaderBytes header{};
    bool has_header = true;  // false for raw handshake bytes
    Payload payload;
    std::size_t charged = 0;
    std::size_t sent = 0;
    // SF frames only: the fds to pass with the first byte, and the message as
    // it was enqueued (for refusal or close: its sender is told).
    std::vector<int> wire_fds;
    FdSet fds_hold;  // keeps wire_fds open until the kernel has them
    std::shared_ptr<const SealedMemfd> body_hold;
    bool fds_sent = false;
    std::unique_ptr<Message> original;
    std::size_t size() const { return (has_header ? kHeaderSize : 0) + payload.size(); }
  };
  // A batch of fds from one recvmsg; the next SF frame parsed takes it.
  struct FdBatch {
    std::vector<UniqueFd> fds;
    bool truncated = false;  // MSG_CTRUNC: the kernel dropped some or all
  };
  // A message waiting for the handshake: how it is framed depends on the peer.
  struct HeldMessage {
    Message msg;
    std::size_t charged = 0;
  };

  Stream(Broker& broker, int read_fd, int write_fd, StreamOptions opts,
         std::unique_ptr<Handshake> handshake, StreamListener* listener);

  void arm_read();
  void arm_write();
  void do_read();
  ssize_t read_once(std::span<std::uint8_t> target);
  void on_read(std::size_t n, bool filled);
  bool bind_fds(Message& m);  // false: refused or protocol error (already handled)
  void protocol_error(const ParseResult& r);
  bool orphan_fds() const;
  void push_frame(Message&& m, std::size_t charged);
  void refuse(Message&& m, std::size_t charged, const std::string& reason);
  bool send_fd_frame_failed(int err);
  void process_input();
  bool run_handshake();  // false if the stream closed
  void on_eof();
  void half_close();
  void queue_raw(std::vector<std::uint8_t> bytes);
  void advance(std::size_t n);
  int gather(struct iovec* iov, std::size_t& want);
  asio::posix::stream_descriptor& writer() { return wr_ ? *wr_ : rd_; }

  Broker& broker_;
  StreamOptions opts_;
  StreamListener* listener_;
  asio::posix::stream_descriptor rd_;
  std::optional<asio::posix::stream_descriptor> wr_;  // pipe pairs only
  bool is_socket_ = false;
  StreamState state_ = StreamState::kHandshaking;
  std::unique_ptr<Handshake> handshake_;
  PeerInfo peer_;
  RxBuffer rx_;
  std::optional<FrameParser> parser_;
  std::deque<OutFrame> txq_;
  std::deque<HeldMessage> held_;  // messages queued before the handshake completed
  std::deque<FdBatch> rx_fds_;    // received fds not yet bound to a frame
  bool had_handshake_ = false;
  std::vector<std::uint8_t> staging_;  // small frames gathered for one write
  std::shared_ptr<OutputGauge> gauge_;
  asio::steady_timer handshake_timer_;
  bool read_armed_ = false, write_armed_ = false;
  bool eof_seen_ = false, write_shut_ = false;
  bool drain_started_here_ = false;  // we said goodbye first (vs. answering the peer's)
  bool close_after_flush_ = false;  // protocol error: stop reading, flush, close
  std::string close_reason_;
  StreamStats stats_;
};

}  // namespace spindle
