// Stream: one connection, and the state machine it runs.
//
//   handshaking --(handshake complete)--> open --(drain / peer EOF)--> draining --> closed
//        \____________________(error, timeout, force close)_______________________/
//
// Role: moves bytes between a file descriptor pair and frames. It reads into
// an RxBuffer of 128 KiB chunks; a Handshake object consumes the first bytes,
// then hands the same buffer to a FrameParser (Mitogen's Stream/Protocol split:
// the protocol changes, the connection stays). Each complete frame goes to the
// listener where it lies (an InFrame): taken as a Message, copied onward, or
// dropped. Output waits in a TxQueue (tx_queue.h) and leaves in gathered
// writes (writev/sendmsg of many frames); an application thread may write an
// idle stream itself through its StreamPort (port.h).
//
// Memory: the stream has an Account (account.h) charged with everything its
// peer makes this process hold: its output queue's blocks, receive chunks its
// messages pin, its large bodies and memfd bodies. While the account is over
// its limit the stream stops reading (back-pressure): the peer's own sends
// then wait in the kernel, not here. Reading resumes when charges go.
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
// memfd body inline, streamed from the memfd a window at a time; a message
// with fds for it is refused the same way.
//
// Draining ("say goodbye"): flush the queue, half-close the write side (EOF to
// the peer), keep reading until the peer's EOF, then close. A peer that sends
// EOF first is answered the same way, so both sides deliver everything queued.
//
// Thread safety: broker thread only, except port(), whose members are safe
// from any thread.
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
#include "broker/fd_closer.h"
#include "stream/account.h"
#include "stream/handshake.h"
#include "stream/output_gauge.h"
#include "stream/parser.h"
#include "stream/port.h"
#include "stream/tx_queue.h"

namespace spindle {

class Stream;
struct ReadResumer;

enum class StreamState { kHandshaking, kOpen, kDraining, kClosed };
const char* to_string(StreamState s);

class StreamListener {
 public:
  virtual ~StreamListener() = default;
  virtual void on_stream_open(Stream& s) = 0;
  // A complete frame, where it lies: take it (f.take()), copy it onward, or
  // leave it (dropped after the call). The default takes it and calls
  // on_stream_message().
  virtual void on_stream_frame(Stream& s, InFrame& f);
  // Before the frames of one read batch (on_stream_batch_end() always follows,
  // even if a handler throws).
  virtual void on_stream_batch_begin(Stream&) {}
  // Frames taken as Messages: by on_stream_frame()'s default, and frames that
  // carried fds (bound to them first).
  virtual void on_stream_message(Stream& s, Message&& m) = 0;
  // After the frames of one read batch, even if the stream has just closed:
  // the moment to flush output corked while handling them.
  virtual void on_stream_batch_end(Stream& s) = 0;
  // A frame that cannot be parsed; the stream closes right after this call
  // (flushing first, so a dead reply queued here is still sent).
  virtual void on_stream_invalid(Stream& s, const ParseResult& r) = 0;
  // A message that cannot travel with its fds: received without them (the
  // kernel dropped them, MSG_CTRUNC), with a memfd body that is not sealed, or
  // refused on send (the peer cannot take fds, sendmsg failed with
  // ETOOMANYREFS/EMFILE, too many fds). `m` is the message (without the fds),
  // so its sender can be told why; the stream stays open. The stream logs
  // only lost fds (this process is out of them: an error); the listener logs
  // the rest, at a rate a peer cannot drive (the default logs each one).
  // `where` says which: a message refused on arrival still claims its
  // sender, unchecked, so the listener must check that claim before it
  // answers it (a peer could otherwise make it fail someone else's call).
  enum class Refused { kOnArrival, kOnSend };
  virtual void on_stream_refused(Stream& s, Message&& m, Refused where, const std::string& reason);
  // After notify_below_mark(): the output queue is under its high-water mark.
  virtual void on_stream_below_mark(Stream&) {}
  // Exactly once. `unsent` is what was still queued, so its senders can be
  // told it was not delivered.
  virtual void on_stream_closed(Stream& s, const std::string& reason, Unsent unsent) = 0;
};

struct StreamOptions {
  std::string name = "stream";
  std::uint32_t max_message_size = kDefaultMaxMessageSize;
  std::size_t high_water_mark = kDefaultHighWaterMark;
  std::chrono::milliseconds handshake_timeout{10000};
  std::size_t memory_limit = kDefaultPeerMemoryLimit;  // the peer's Account
  std::shared_ptr<MemoryBudget> budget;                // shared by a router's peers
  // The peer's uid, whose part of the budget it shares (MemoryBudget); if
  // unset, this process's (a parent or a child).
  std::optional<std::uint32_t> uid;
  // A peer over its memory limit whose own output makes no progress for this
  // long is disconnected (0: never).
  std::chrono::milliseconds stall_timeout{10000};
  // A peer that may be hostile (a router's listener clients; a parent or a
  // child is trusted). Two rules apply to it only:
  // - it is disconnected when it takes nothing from a queue over the
  //   high-water mark for stall_timeout, even if it sends nothing (a trusted
  //   child that is merely slow is waited for);
  // - a memfd body it sends must fit its memory allowance when it arrives
  //   (its own limit and the router's global one), or it is refused with a
  //   dead reply: one frame could otherwise charge it (and the router) up to
  //   the maximum message size at once. A trusted link may send one body
  //   larger than its limit, as any message (Account::try_charge).
  //   An untrusted peer's inline body obeys the same allowance: a frame it
  //   sends may be no larger than its allowance (untrusted_receive_limit; the
  //   listener announces it), a large body is read only once its whole size
  //   fits (reading pauses until it does), and a body once begun must arrive
  //   at kMinBodyRate or faster, or the peer is disconnected: its charge is
  //   held only as long as an honest sender takes. A smaller frame, whose
  //   bytes wait in the receive chunks, must be finished within
  //   stall_timeout plus its largest size at that rate (watch_partial).
  bool untrusted = false;
  // The fds this process holds for all its peers (shared by a router's
  // links; may be null). An untrusted peer's fds are taken only while the
  // budget admits them (FdBudget::admits), and must be bound to their frames
  // within stall_timeout (a frame never completed must not pin them).
  std::shared_ptr<FdBudget> fd_budget;
  // Once a goodbye is flushed, close without waiting for the peer's EOF. For
  // a pipe link whose peer sees our EOF only when we exit: an agent behind
  // ssh, whose client keeps its own copy of the stdout it relays, so our
  // half-close never reaches the parent, and waiting for the parent's EOF
  // (which waits for ours) would last the whole shutdown grace. A pipe has
  // no reset to lose written bytes: what was flushed is still delivered.
  bool close_when_drained = false;
};

// The largest frame an untrusted peer may send: what it may make us hold.
std::uint32_t untrusted_receive_limit(std::uint32_t max_message_size, std::size_t peer_limit,
                                      std::size_t global_limit);
// How fast an untrusted peer must send a large body it has begun (after a
// grace of one stall_timeout): an honest local sender writes hundreds of MB/s.
inline constexpr std::size_t kMinBodyRate = 4u << 20;  // bytes per second

struct StreamStats {
  std::uint64_t bytes_in = 0, bytes_out = 0;
  std::uint64_t messages_in = 0, messages_out = 0;
  std::uint64_t writes = 0;  // write syscalls that moved bytes
  std::uint64_t fds_in = 0, fds_out = 0;
  std::uint64_t read_pauses = 0;  // times reading stopped for the memory limit
  std::uint64_t read_waits = 0;   // times reading waited for readability (epoll)
  std::uint64_t read_turns = 0;   // broker turns that read from the socket
  std::uint64_t peer_holds = 0;   // times reading stopped for a destination over its mark
};

class Stream final : public std::enable_shared_from_this<Stream>, public InputTurns::Turn {
 public:
  // Takes ownership of the fds (read_fd == write_fd for a socket); closes them
  // if it throws. Sets them non-blocking. Throws std::system_error if an fd
  // is unusable.
  static std::shared_ptr<Stream> create(Broker& broker, int read_fd, int write_fd,
                                        StreamOptions opts, std::unique_ptr<Handshake> handshake,
                                        StreamListener* listener);
  ~Stream();

  void start();
  // Queues a message; `charged` bytes of it are already on the gauge (the
  // rest, if any, is charged here, even over the mark: control traffic and
  // dead replies are the peer's own doing). Does not write.
  void enqueue(Message&& m, std::size_t charged);
  // Queues a frame that is still in another stream's receive buffer: small
  // bodies are copied into the queue, large ones taken where they lie.
  // `header` is the frame's header as it is to be sent.
  void enqueue_frame(const Header& header, InFrame& f, std::size_t charged);
  // Queues a frame whose body is bytes the caller keeps (copied).
  void enqueue_bytes(const Header& header, std::span<const std::uint8_t> body, std::size_t charged);
  // Writes what is queued unless a write is already waiting for readiness.
  void flush();
  // Graceful: flush, say goodbye, wait for the peer's EOF. While handshaking,
  // the handshake completes first and what was held behind it is sent.
  void drain();
  void close(const std::string& reason);
  // The process at the other end has exited (its parent reaped it): nothing
  // more can come from it, however many processes still hold a copy of its
  // end (one it forked keeps it open, and so no EOF comes). What it wrote
  // before is read and delivered as usual; where the stream would next wait
  // for input, it closes with `reason` instead.
  void peer_exited(const std::string& reason);

  StreamState state() const { return state_; }
  bool is_open() const { return state_ == StreamState::kOpen; }
  // Whether enqueue() will still send: messages queued while handshaking are
  // held back and go out right after the handshake.
  bool accepts_output() const {
    return state_ == StreamState::kHandshaking || state_ == StreamState::kOpen ||
           (state_ == StreamState::kDraining && !write_shut_ && !close_after_flush_);
  }
  const std::string& name() const { return opts_.name; }
  void set_name(std::string name);
  const PeerInfo& peer() const { return peer_; }
  // messages_out is counted here, when asked (TxQueue::frames_written()).
  const StreamStats& stats() {
    stats_.messages_out = tx_.frames_written();
    return stats_;
  }
  // Receive chunks the stream holds: none while it waits for input with
  // nothing unread and no message holding its chunk.
  std::size_t receive_chunks() const { return rx_.chunk_count(); }
  std::size_t queued_frames() const { return tx_.frames_queued() + (tx_.queued_bytes() ? 1 : 0); }
  OutputGauge& gauge() { return port_->gauge; }
  const std::shared_ptr<StreamPort>& port() const { return port_; }
  const std::shared_ptr<Account>& account() const { return account_; }
  // The largest body this stream carries either way: this side's maximum,
  // or the peer's if it announced a lower one (PeerInfo::max_message_size).
  std::uint32_t max_message_size() const {
    const std::uint32_t peer = peer_.max_message_size;
    return peer != 0 && peer < opts_.max_message_size ? peer : opts_.max_message_size;
  }
  // Whether fds can travel to the peer: a socket, and the peer announced
  // kFlagFdPassing (a stream without a handshake assumes it on a socket).
  bool peer_takes_fds() const;
  // Whether one sendmsg may carry the fds of several SF frames (both sides
  // announced kFlagFdBatches).
  bool peer_takes_fd_batches() const;
  // Whether a memfd body may be a range of its memfd (both sides announced
  // kFlagMemfdRanges).
  bool peer_takes_memfd_ranges() const;
  bool reading_paused() const { return paused_; }
  bool held_for_peer() const { return peer_holds_ > 0; }
  // Reads and delivers nothing from the peer for `d`, from the next frame on
  // (the rest of this batch waits too): backpressure on a peer that goes over
  // a rate the listener enforces, so its excess costs us no work at all.
  // Broker thread only.
  void hold_input(std::chrono::milliseconds d);
  // Reads nothing from the peer until as many release_peer_hold() calls as
  // holds (from the next frame on): the listener queued one of its frames
  // for a destination already over its high-water mark (backpressure: the
  // peer's own sends then wait in the kernel and in its sender's gauge, and
  // nothing is dropped). Broker thread only.
  void hold_for_peer();
  void release_peer_hold();
  // The listener hears on_stream_below_mark() once, when this stream's output
  // queue is next under its high-water mark (at once if it is now).
  void notify_below_mark();
  // The owner's own pointer (the Router's link), so it needs no lookup per frame.
  void set_tag(void* t) { tag_ = t; }
  void* tag() const { return tag_; }

 private:
  // A batch of fds from one recvmsg; the next SF frame parsed takes it.
  // Fds it still holds when it goes (a frame that never came, a closed
  // stream) close through fd_closer: a peer's socket must not make this
  // thread wait in close().
  struct FdBatch {
    std::vector<UniqueFd> fds;
    bool truncated = false;  // MSG_CTRUNC: the kernel dropped some or all
    bool refused = false;    // not taken: the fd budget was spent
    std::shared_ptr<void> charge;  // on the fd budget; shared by the frames' FdSets

    FdBatch() = default;
    FdBatch(FdBatch&&) = default;
    FdBatch& operator=(FdBatch&& o) noexcept {
      if (this != &o) {
        release();
        fds = std::move(o.fds);
        truncated = o.truncated;
        refused = o.refused;
        charge = std::move(o.charge);
      }
      return *this;
    }
    ~FdBatch() { release(); }
    void release() noexcept { fd_closer::close_received(std::move(fds), std::move(charge)); }
  };
  // A message waiting for the handshake: how it is framed depends on the peer.
  struct HeldMessage {
    Message msg;
    std::size_t charged = 0;
  };

  Stream(Broker& broker, int read_fd, int write_fd, StreamOptions opts,
         std::unique_ptr<Handshake> handshake, StreamListener* listener);

  void wire_up();
  void arm_read();
  void arm_write();
  void arm_stall_timer();
  bool stalled() const;  // paused over the limit, or (untrusted) output over the mark
  void note_queued();
  void do_read();
  // One recvmsg (read on a pipe). `at_fds`: the read brought fds, and so
  // ended at the message that carried them (its shortness says nothing
  // about what is left).
  ssize_t read_once(std::span<std::uint8_t> target, bool& at_fds);
  void commit_read(std::size_t n);  // n bytes arrived in the read target
  void on_read(bool filled);        // after a turn's reads: parse, then read or wait
  void queue_input_turn();
  void input_turn();
  std::size_t run_input_turn() override;  // InputTurns: input_turn(), returns the frames delivered
  bool over_limit();
  void make_parser();
  // How what the peer sends is charged to its account (its large and memfd bodies).
  PeerCharge peer_charge() const {
    return opts_.untrusted ? PeerCharge::kWithinLimits : PeerCharge::kAlways;
  }
  bool fail_handshake(const std::string& error);  // returns false
  void wait_for_memory(std::size_t body_size);
  void watch_body();  // untrusted: times the large body under way
  void watch_fds();   // untrusted: times the fds not yet bound to a frame
  void watch_partial();  // untrusted: times a small frame left unfinished
  bool partial_frame_waits_on_peer() const;
  bool holds_unbound_fds() const { return !rx_fds_.empty() || batch_left_ > 0; }
 public:
  void resume_reading();  // via ReadResumer, on the broker thread
 private:
  bool bind_fds(Message& m);  // false: refused or protocol error (already handled)
  // Maps a ranged memfd body into `m.data`; the reason if it is refused.
  std::string view_memfd_range(Message& m, const SealedMemfd& body);
  std::string too_large(std::uint64_t size) const;  // the refusal's text
  void protocol_error(const ParseResult& r);
  bool orphan_fds() const;
  void push_frame(Message&& m, std::size_t charged);
  // `range`: only that span of the body is the memfd (a ranged memfd body).
  void push_fd_frame(Message&& m, std::size_t charged, std::shared_ptr<const SealedMemfd> body,
                     const MemfdSpan* range = nullptr);
  void refuse(Message&& m, std::size_t charged, const std::string& reason);
  bool send_fd_frame_failed(int err);
  bool process_input();  // true: stopped at its turn's budget with frames left
  void deliver(InFrame& f);
  bool run_handshake();  // false if the stream closed
  void on_eof();
  void half_close();
  void queue_raw(const std::vector<std::uint8_t>& bytes);
  void after_write();
  void take_over(TxFrame* rest, const std::string& error);
  void close_fds();
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
  std::shared_ptr<Account> account_;
  std::shared_ptr<StreamPort> port_;
  RxBuffer rx_;
  std::optional<FrameParser> parser_;
  TxQueue tx_;
  std::deque<HeldMessage> held_;  // messages queued before the handshake completed
  std::deque<FdBatch> rx_fds_;    // received fds not yet bound to a frame
  // The batch SF frames are taking their fds from: its fds from `bound_` on
  // are not taken yet, and `batch_left_` more are owed to frames still to
  // come (a truncated batch owes more than it holds).
  FdBatch batch_;
  std::size_t bound_ = 0, batch_left_ = 0;
  bool accept_fd_extensions_ = false;  // we announced kFlagFdBatches and kFlagMemfdRanges
  bool had_handshake_ = false;
  asio::steady_timer handshake_timer_;
  asio::steady_timer stall_timer_;
  asio::steady_timer hold_timer_;  // hold_input(): reading resumes when it fires
  asio::steady_timer body_timer_;  // watch_body(): the body under way is late
  std::uint64_t body_watched_ = 0;  // parser_->bodies_begun() when body_timer_ was set
  asio::steady_timer partial_timer_;  // watch_partial()
  bool partial_watched_ = false;
  std::uint64_t partial_mark_ = 0;  // stats_.messages_in when partial_timer_ was set
  asio::steady_timer fds_timer_;   // watch_fds()
  bool fds_watched_ = false;
  std::uint64_t batches_done_ = 0;  // fd batches bound whole to their frames
  std::uint64_t fds_mark_ = 0;      // batches_done_ when fds_timer_ was set
  std::uint64_t stall_mark_ = 0;  // bytes_out when the stall timer was armed
  bool stall_armed_ = false;
  std::shared_ptr<ReadResumer> resumer_;
  bool busy_ = true;              // the gate says kBusy (mirrors it for the broker)
  bool read_armed_ = false, write_armed_ = false;
  bool input_left_ = false;       // parsed frames remain for the next turn
  bool last_read_filled_ = false;  // more is likely waiting in the socket
  bool paused_ = false;           // reading stopped: the account is over its limit
  bool memory_wait_ = false;      // paused: a large body's header waits for room
  bool input_held_ = false;       // reading stopped by hold_input() until hold_timer_
  std::uint32_t peer_holds_ = 0;  // hold_for_peer() not yet released
  bool watch_mark_ = false;       // notify_below_mark() asked: a peer is held for this one
  std::chrono::steady_clock::time_point watch_since_{};  // when watch_mark_ was last set
  bool input_stopped() const { return input_held_ || peer_holds_ > 0; }
  // Whether the peer may be read now: not held, and nothing ended reading
  // (closed, EOF, or a protocol error waiting for its flush).
  bool may_read() const {
    return !input_stopped() && state_ != StreamState::kClosed && !eof_seen_ && !close_after_flush_;
  }
  void note_below_mark();
  bool eof_seen_ = false, write_shut_ = false;
  bool drain_started_here_ = false;  // we said goodbye first (vs. answering the peer's)
  bool close_after_flush_ = false;  // protocol error: stop reading, flush, close
  bool fds_closed_ = false;
  std::string close_reason_;
  std::optional<std::string> peer_exited_;  // peer_exited(): why the next wait closes instead
  bool waiting_input_ = false;              // an async_wait for input is pending
  bool input_drained();                     // the peer's end holds nothing more for us to read
  StreamStats stats_;
  void* tag_ = nullptr;
};

}  // namespace spindle
