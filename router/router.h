// Router: delivers messages between numbered contexts.
//
// Role: owns this context's streams and its route table (context id -> the
// stream that reaches it), dispatches local messages by handle through a
// HandlerTable, matches replies by reply_to, forwards anything else towards
// its route or, failing that, up to the parent. It propagates ADD_ROUTE and
// DEL_ROUTE, fails pending calls the moment their respondent disconnects, and
// answers every failure with a dead reply that names the reason (see
// reasons.h). A message without reply_to that cannot be delivered is logged
// with its reason, since there is nowhere to send one.
//
// Ids: the root context is 0. The root allocates ids from a counter that only
// grows (never reused within a run); other contexts ask the root with
// ALLOCATE_ID.
//
// Thread safety: send(), route(), request(), call(), add_handler(), del_handler(),
// on_disconnect() and allocate_id() are safe from any thread. Stream events
// and routing run on the broker thread. allocate_id() and attach_parent()
// block, so they must not run on the broker thread.
// Ownership: borrows the Broker, which must outlive it; owns its streams.
// Destroying a Router shuts its broker down and joins it first.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "broker/broker.h"
#include "router/handlers.h"
#include "stream/stream.h"

namespace spindle {

struct RouterOptions {
  std::string name;  // this context's name, for logs
  std::uint32_t max_message_size = kDefaultMaxMessageSize;
  std::size_t high_water_mark = kDefaultHighWaterMark;
  std::chrono::milliseconds handshake_timeout{10000};
  bool unidirectional = false;  // children may not reach their siblings
  // fds (a memfd body counts as one) that one peer may have in flight through
  // this router, queued towards other peers; over it: dead reply (router/fds.cpp).
  std::size_t fd_quota = 1024;
  // Payloads of at least this many bytes travel as a sealed memfd (shm/memfd.h).
  std::size_t memfd_threshold = 1u << 20;
};

enum class StreamRole { kParent, kChild };

// A client of a listening router (spindle-router): a child-like link whose
// context id is assigned during its handshake.
struct ClientLinkOptions {
  // Same-uid clients are trusted with the router's authority, as in Mitogen's
  // listener: their messages carry the router's auth_id from here on.
  bool trusted = true;
  std::uint32_t pid = 0;  // from SO_PEERCRED, for logs and stats
  std::uint32_t uid = 0;
};

// One client as the stats service reports it.
struct ClientStats {
  std::uint32_t id = 0;  // 0 while the handshake runs
  std::string name;
  Dialect dialect = Dialect::kSpindle;
  std::uint32_t pid = 0, uid = 0;
  std::uint64_t messages_in = 0, messages_out = 0, bytes_in = 0, bytes_out = 0;
  std::size_t queued_bytes = 0;
};

struct RouterStats {
  std::uint64_t routed = 0, delivered_locally = 0, dead_replies = 0, dropped_logged = 0;
  std::size_t streams = 0, routes = 0, handlers = 0;
};

class Router : public StreamListener, public ShutdownParticipant {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr std::chrono::milliseconds kDefaultSendTimeout{30000};

  explicit Router(Broker& broker, RouterOptions opts = {});
  ~Router() override;
  Router(const Router&) = delete;
  Router& operator=(const Router&) = delete;

  std::uint32_t id() const { return id_.load(std::memory_order_acquire); }
  std::optional<std::uint32_t> parent_id() const;
  // Whether the link to the parent is up (false before attach and after loss).
  bool parent_connected() const { return parent_up_.load(std::memory_order_acquire); }
  Broker& broker() { return broker_; }
  const RouterOptions& options() const { return opts_; }

  // --- any thread ---
  std::uint32_t add_handler(HandlerFn fn, HandlerOptions opts = {}, std::uint32_t handle = 0);
  bool del_handler(std::uint32_t handle);
  // Sends from this context (src_id = auth_id = id()). Waits while the
  // destination's output queue is over its high-water mark, up to `timeout`.
  // Throws QueueFullError, ChannelError (peer gone), ShutdownError, or Error
  // (message too large).
  void send(Message msg, std::chrono::milliseconds timeout = kDefaultSendTimeout);
  // Like send(), but never waits: a destination queue at its high-water mark
  // throws QueueFullError at once (the "sender gets an error" policy).
  void route(Message msg);
  // A request whose reply (or dead reply, or CallError) completes the future.
  // The timeout fails it with TimeoutError; a respondent that disconnects
  // fails it at once with ChannelError.
  std::future<Message> request(Message msg, std::chrono::milliseconds timeout);
  // The same, blocking: returns the reply or throws. Not on the broker thread.
  Message call(Message msg, std::chrono::milliseconds timeout);
  // Replies to a message that arrived here.
  void reply(const Message& request, Payload data, std::uint16_t enc = kEncRaw);
  // Calls fn(reason) once when `context_id` disconnects (or is unreachable).
  void on_disconnect(std::uint32_t context_id, std::function<void(const std::string&)> fn);
  std::uint32_t allocate_id();
  RouterStats stats();
  // While held, a message for a handle nobody registered yet waits (up to
  // high_water_mark bytes in all) instead of getting "invalid handle": a
  // starting child holds until its main has registered its handlers.
  // Releasing dispatches what waited, in order, before it returns.
  void hold_unknown_handles(bool hold);

  // --- streams ---
  // Connects this (non-root) router to its parent over the given fds and
  // blocks until the handshake completes. Throws Error on failure.
  void attach_parent(int read_fd, int write_fd);
  // Broker thread: adds a child stream whose context id is already known.
  // Once shutdown has begun it closes the fds instead and returns nullptr.
  std::shared_ptr<Stream> add_child_stream(int read_fd, int write_fd, std::uint32_t child_id,
                                           const std::string& name);
  // Broker thread: adopts an accepted client socket. `handshake` assigns its
  // id (a ListenerHandshake); the route is added when the handshake completes.
  // Once shutdown has begun it closes the fd instead and returns nullptr.
  std::shared_ptr<Stream> add_client_stream(int fd, const std::string& name,
                                            std::unique_ptr<Handshake> handshake,
                                            ClientLinkOptions opts);
  // Client links, including those still handshaking (any thread; exact on
  // the broker thread, a snapshot elsewhere).
  std::size_t client_count() const { return clients_.load(std::memory_order_relaxed); }
  // Any thread except the broker's after it stopped: a snapshot of the clients.
  std::vector<ClientStats> client_stats();

  // StreamListener (broker thread)
  void on_stream_open(Stream& s) override;
  void on_stream_message(Stream& s, Message&& m) override;
  void on_stream_batch_end(Stream& s) override;
  void on_stream_invalid(Stream& s, const ParseResult& r) override;
  void on_stream_refused(Stream& s, Message&& m, const std::string& reason) override;  // fds.cpp
  void on_stream_closed(Stream& s, const std::string& reason, std::vector<Message> unsent) override;
  // ShutdownParticipant (broker thread)
  void on_shutdown_begin() override;
  void on_shutdown_deadline() override;

 private:
  struct Link {
    std::shared_ptr<Stream> stream;
    StreamRole role;
    std::uint32_t remote_id = 0;
    std::string name;
    std::unordered_set<std::uint32_t> behind;   // contexts routed through this link
    std::unordered_set<std::uint32_t> egress;   // contexts this link sent to
    std::optional<ClientLinkOptions> client;    // set for a listener's clients
    Dialect dialect = Dialect::kSpindle;        // known once the handshake is done
    // fds this peer has in flight through us (released as they are written).
    std::shared_ptr<std::atomic<std::size_t>> fds_in_flight =
        std::make_shared<std::atomic<std::size_t>>(0);
  };
  // A pending call's deadline; expire() fails it with TimeoutError.
  struct CallDeadline {
    Clock::time_point when;
    std::function<void()> expire;
  };
  struct Outgoing {
    Message msg;
    std::shared_ptr<OutputGauge> gauge;  // charged on the sender's thread
    std::optional<CallDeadline> deadline;  // for requests: armed on the broker thread
  };

  using CallCompletion = std::function<void(Message&&, std::exception_ptr)>;
  void start_call(Message msg, std::chrono::milliseconds timeout, CallCompletion done);
  void send_impl(Message msg, std::chrono::milliseconds timeout,
                 std::optional<CallDeadline> deadline);
  // broker thread
  void arm_deadline(std::uint32_t handle, CallDeadline d);
  void arm_deadline_timer(Clock::time_point when);
  void cancel_deadline(std::uint32_t handle);
  void expire_deadlines();
  void drain_outbox();
  void flush_dirty();
  void route_local_origin(Outgoing&& out);
  void forward(Link& in, Message&& m);
  void deliver(Message&& m, Link* in);
  void dispatch_local(Message&& m);
  bool handle_control(Link& in, Message& m);
  void send_dead(const Message& about, std::string reason);
  void send_internal(Message&& m);  // charge-free, broker thread: control and dead
  bool enqueue_on(Link& out, Message&& m, std::size_t charged);
  // A Mitogen peer cannot decode a Spindle encoding: says why instead.
  void refuse_undecodable(Link& out, Message&& m);
  Link* route_for(std::uint32_t dst);
  Link* link_of(const Stream& s);
  void add_route(std::uint32_t id, Link& via);
  void remove_route(std::uint32_t id);
  // Fails what waited on `id`, fires its watchers and sends DEL_ROUTE to the
  // parent and to every link that talked to it, except `told_by`.
  void context_gone(std::uint32_t id, const std::string& reason, Link* told_by = nullptr);
  void announce(std::uint32_t handle, const std::string& payload, Link* skip,
                const std::unordered_set<Link*>& to);
  void maybe_drained();
  void release_held();
  bool hold(Message& m);
  Link& register_link(std::shared_ptr<Stream> s, StreamRole role, std::uint32_t remote_id,
                      const std::string& name);
  void client_opened(Link& l);
  std::shared_ptr<OutputGauge> gauge_for(std::uint32_t dst);
  void fail_handlers(std::vector<HandlerPtr> hs, const std::string& reason);
  // fds.cpp: a sender's fds and large payloads (any thread), the per-peer fd
  // quota when forwarding, and mapping a memfd body before local delivery.
  void prepare_fds_for_send(Message& msg);
  bool charge_fds(Link& in, Message& m);
  bool map_sealed_body(Message& m);

  Broker& broker_;
  RouterOptions opts_;
  std::atomic<std::uint32_t> id_{0};
  std::atomic<std::uint32_t> next_id_{1};  // root only
  std::atomic<bool> parent_up_{false};
  HandlerTable handlers_;

  // broker thread only
  std::unordered_map<Stream*, std::unique_ptr<Link>> links_;
  std::atomic<std::size_t> clients_{0};
  std::unordered_map<std::uint32_t, Link*> routes_;
  Link* parent_ = nullptr;
  std::unordered_set<Stream*> dirty_;
  int batch_depth_ = 0;
  bool shutting_down_ = false;
  // Pending-call deadlines: one timer, armed for the earliest, re-armed only
  // when an earlier deadline arrives or the armed one fires.
  std::multimap<Clock::time_point, std::pair<std::uint32_t, std::function<void()>>> deadlines_;
  std::unordered_map<std::uint32_t, decltype(deadlines_)::iterator> deadline_of_;
  asio::steady_timer deadline_timer_;
  Clock::time_point armed_for_ = Clock::time_point::max();
  bool hold_unknown_ = false;
  std::vector<Message> held_unknown_;
  std::size_t held_bytes_ = 0;
  std::unordered_set<std::uint32_t> held_handles_;  // handles with messages held
  RouterStats stats_;

  // any thread
  mutable std::mutex gauges_mu_;
  std::unordered_map<std::uint32_t, std::shared_ptr<OutputGauge>> gauges_;
  std::shared_ptr<OutputGauge> parent_gauge_;
  std::optional<std::uint32_t> parent_id_;  // guarded by gauges_mu_

  std::mutex outbox_mu_;
  std::vector<Outgoing> outbox_;

  std::mutex disconnect_mu_;
  std::unordered_map<std::uint32_t, std::vector<std::function<void(const std::string&)>>>
      disconnect_watchers_;

  // attach_parent's handshake result
  std::promise<std::string> parent_ready_;
  bool parent_ready_set_ = false;
};

}  // namespace spindle
