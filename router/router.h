// Router: delivers messages between numbered contexts.
//
// Role: owns this context's streams and its route table (context id -> the
// stream that reaches it), dispatches local messages by handle through a
// HandlerTable, completes pending calls (CallTable), forwards anything else
// towards its route or, failing that, up to the parent. It propagates
// ADD_ROUTE and DEL_ROUTE, fails pending calls the moment their callee
// disconnects, and answers every failure with a dead reply that names the
// reason (see reasons.h). A message without reply_to that cannot be
// delivered is counted and logged, aggregated, since there is nowhere to send
// a reply.
//
// Data path (docs/DESIGN.md, "The data path"):
//  - application threads: a send charges the destination's gauge, writes the
//    frame itself when the stream is idle, and otherwise appends it to the
//    Outbox (a lock-free ring), waking the broker once per batch;
//  - broker thread: a frame forwarded from one stream to another is never
//    turned into a Message: its header is rewritten and its bytes copied
//    straight into the other stream's TxQueue (or, for a large body, moved).
//  - every byte held for a peer is charged to the peer's Account; a peer over
//    its limit is not read until it is back under.
//
// Ids: the root context is 0. The root allocates ids from a counter that only
// grows (never reused within a run); other contexts ask the root with
// ALLOCATE_ID for a block of ids and take their next ones from it.
//
// Thread safety: send(), route(), request(), call(), add_handler(), del_handler(),
// on_disconnect() and allocate_id() are safe from any thread. Stream events
// and routing run on the broker thread. allocate_id() and attach_parent()
// block, so they must not run on the broker thread.
// Ownership: borrows the Broker, which must outlive it; owns its streams.
// Destroying a Router shuts its broker down and joins it first.
#pragma once

#include <sys/types.h>

#include <array>
#include <atomic>
#include <chrono>
#include <concepts>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "broker/broker.h"
#include "spindle/options.h"
#include "router/call_table.h"
#include "router/handlers.h"
#include "router/id_grants.h"
#include "router/outbox.h"
#include "router/router_link.h"
#include "stream/stream.h"

namespace spindle {

struct BudgetRelief;

// A token bucket: what one peer may make this process log.
class LogBudget {
 public:
  bool take(std::chrono::steady_clock::time_point now, double rate, double burst);
  // Lines refused since the last report, at most one report a second.
  std::uint64_t take_suppressed(std::chrono::steady_clock::time_point now);
  // After a refused take(): how long until the next line would be taken.
  std::chrono::milliseconds refill_time(double rate) const;

 private:
  double tokens_ = -1;  // full on first use
  std::chrono::steady_clock::time_point last_{};
  std::uint64_t suppressed_ = 0;
  std::chrono::steady_clock::time_point reported_at_{};
};

enum class StreamRole { kParent, kChild };

// A client of a listening router (spindle-router): a child-like link whose
// context id is assigned during its handshake.
struct ClientLinkOptions {
  bool trusted = true;    // same uid as the router (docs/PROTOCOL.md §2.10)
  std::uint32_t pid = 0;  // from SO_PEERCRED, for logs and stats
  std::uint32_t uid = process_uid();  // SO_PEERCRED's
};

// One client as the stats service reports it.
struct ClientStats {
  std::uint32_t id = 0;  // 0 while the handshake runs
  std::string name;
  Dialect dialect = Dialect::kSpindle;
  std::uint32_t pid = 0, uid = 0;
  std::uint64_t messages_in = 0, messages_out = 0, bytes_in = 0, bytes_out = 0;
  std::uint64_t writes = 0;  // write syscalls that carried messages_out
  std::size_t queued_bytes = 0;
  std::size_t memory_held = 0, memory_peak = 0;  // its Account
  std::size_t fds_held = 0;                      // fds it sent that are still held
  std::size_t state_held = 0;                    // its routes and egress (Link::state)
  bool paused = false;          // not read: over its memory limit
  bool held = false;            // not read: a destination of its frames is over its mark
  std::uint64_t holds = 0;      // times that happened
};

struct RouterStats {
  std::uint64_t routed = 0, delivered_locally = 0, dead_replies = 0, dropped_logged = 0;
  // Links that closed, and the entries their teardown visited: its routes,
  // the contexts it sent to, the links told it has gone, its unsent messages
  // and the pending-call slots scanned. A departure costs O(what it owned),
  // never O(everything the router holds): this is how a test checks it.
  std::uint64_t departures = 0, departure_steps = 0;
  // Frames application threads wrote to an idle stream themselves (no queue,
  // no wake-up of the broker), summed over the streams open now.
  std::uint64_t direct_writes = 0;
  std::size_t streams = 0, routes = 0, handlers = 0;
  std::size_t pending_calls = 0;
  std::size_t call_slots = 0;  // CallTable::slots(): grows with calls open at once
  std::size_t memory_held = 0, memory_peak = 0, memory_limit = 0;  // all peers together
  std::size_t fds_held = 0, fd_limit = 0;  // fds held for all peers (FdBudget)
  std::size_t state_held = 0, state_limit = 0;  // routes kept for clients (Link::state)
};

class Router : public StreamListener, public ShutdownParticipant {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr std::chrono::milliseconds kDefaultSendTimeout{30000};
  // What a client's link costs it (Link::state) for each context routed
  // through it (the route, its port, the link's set; the name and
  // disconnect watcher the context may register) and for each context it
  // sent to (its egress and talker entries). Rounded up from what they
  // cost: a route without a name grew the router's RSS by about 230 bytes
  // (Hardening.TheRoutesAClientAnnouncesAreChargedToItAndShared prints it).
  static constexpr std::size_t kRouteStateBytes = 512;
  // How many lines a second each kind of a client's arrival and departure
  // lines may take before they are counted instead (SummaryLog).
  static constexpr std::uint32_t kClientLinesPerSecond = 64;
  static constexpr std::size_t kEgressStateBytes = 128;
  // What a client is charged for each request of its that a handler here
  // holds (queued for a service, running, or its answer deferred), until the
  // answer is queued for it and charged at its own size (Message::
  // sender_charge). A cheap request can cost a large answer: without it a
  // client that never read 20,000 names.find answers of 14 KB made the
  // router hold 450 MB past a 16 MiB limit. With it, reading such a client
  // pauses once its pledges and queued answers reach its limit, so the calls
  // it has in flight number at most limit / kCallInFlightBytes (4,096 at the
  // default 64 MiB), checked frame by frame.
  static constexpr std::size_t kCallInFlightBytes = 16 << 10;

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
  // What Contexts hold to reach this router (cleared by the destructor).
  const std::shared_ptr<detail::RouterLink>& link() const { return link_; }

  // --- any thread ---
  // Throws Error if an explicit handle is taken (or is a call handle).
  std::uint32_t add_handler(HandlerFn fn, HandlerOptions opts = {}, std::uint32_t handle = 0);
  bool del_handler(std::uint32_t handle);
  // Sends from this context (src_id = auth_id = id()). Waits while the
  // destination's output queue is over its high-water mark, up to `timeout`.
  // Throws QueueFullError, ChannelError (peer gone), ShutdownError, or Error
  // (message too large).
  void send(Message msg, std::chrono::milliseconds timeout = kDefaultSendTimeout);
  // The same for bytes the caller keeps (copied; no Payload is built).
  void send(std::uint32_t dst, std::uint32_t handle, std::span<const std::uint8_t> bytes,
            std::uint16_t enc = kEncRaw, std::chrono::milliseconds timeout = kDefaultSendTimeout);
  // SendBatch (api/send_batch.h): while this thread's mark is open and
  // names `link`, its router's send()s from this thread are queued without a
  // wake-up and never written on this thread. gather_sends() makes the mark
  // and returns it with the one it replaces (batches nest). The link, not
  // the Router, names the batch: the batch holds it, so its address cannot
  // pass to another router meanwhile.
  struct GatherMarks {
    std::shared_ptr<void> mine, previous;
  };
  static GatherMarks gather_sends(const detail::RouterLink* link);
  // Closes `marks.mine` from any thread (a batch left on another thread
  // leaves a closed mark behind, never one that gathers for ever); on the
  // thread whose mark it is, the previous one is restored. True if an open
  // batch of the same runtime encloses it: that one hands over.
  static bool end_gather(GatherMarks marks);
  // The end of a batch: the broker takes what it gathered (one wake-up).
  void hand_over_sends() { broker_.wake(); }
  // Like send(), but never waits: a destination queue at its high-water mark
  // throws QueueFullError at once (the "sender gets an error" policy).
  void route(Message msg);
  // A reply that must never block its sender (a service worker): charged to
  // the receiver however full its queue is, since the receiver asked for it.
  // Errors (the receiver gone) are logged, not thrown.
  void post_reply(Message msg);
  // A request whose reply (or dead reply, or CallError) completes the future.
  // The timeout fails it with TimeoutError; a callee that disconnects fails
  // it at once with ChannelError.
  std::future<Message> request(Message msg, std::chrono::milliseconds timeout);
  // The same with a completion callback instead of a future: it runs once,
  // on the broker thread, with the reply or the error.
  void request(Message msg, std::chrono::milliseconds timeout, CallTable::Completion done);
  // The same, blocking: returns the reply or throws. Not on the broker thread.
  Message call(Message msg, std::chrono::milliseconds timeout);
  // Replies to a message that arrived here (as post_reply(): never waits).
  void reply(const Message& request, Payload data, std::uint16_t enc = kEncRaw);
  // Calls fn(reason) once when `context_id` disconnects (or is unreachable).
  void on_disconnect(std::uint32_t context_id, std::function<void(const std::string&)> fn);
  // on_disconnect(), if `context_id` has a route here now; false, and fn
  // dropped, if it has none (it left, or lives above this router's parent).
  // Blocks for a broker round trip when called on another thread.
  bool watch_if_routed(std::uint32_t context_id, std::function<void(const std::string&)> fn);
  // Broker thread: the process of child `id` has exited (`how`: its wait
  // status in words). A link to it still open (a process the child forked
  // holds the other end, so no EOF comes) ends once what the child wrote is
  // read, and what waited on it fails with that reason.
  void child_exited(std::uint32_t id, const std::string& how);
  // Broker thread: this context's parent process has exited; the parent link
  // ends as a child's does in child_exited().
  void parent_exited();
  std::uint32_t allocate_id();
  // Tests only (router/ is not the public API): the root's next fresh id is
  // at least `next`, so a test can reach the end of the id space. It only
  // ever raises the counter.
  void skip_ids_for_testing(std::uint32_t next);
  RouterStats stats();
  // While held, a message for a handle nobody registered yet waits (up to
  // high_water_mark bytes in all, each fd it carries counted as
  // fd_charge(1) bytes) instead of getting "invalid handle": a
  // starting child holds until its main has registered its handlers.
  // Releasing dispatches what waited, in order, before it returns.
  void hold_unknown_handles(bool hold);

  // --- streams ---
  // Connects this (non-root) router to its parent over the given fds and
  // blocks until the handshake completes. Throws Error on failure.
  void attach_parent(int read_fd, int write_fd, bool close_when_drained = false);
  // Broker thread: adds a child stream whose context id is already known.
  // Once shutdown has begun it closes the fds instead and returns nullptr.
  std::shared_ptr<Stream> add_child_stream(int read_fd, int write_fd, std::uint32_t child_id,
                                           const std::string& name);
  // Broker thread: when `s` closes, `explain(reason)` gives the reason its
  // contexts' pending calls and dead replies carry (an ssh session adds
  // ssh's exit status and last stderr line). It owns what it captures until
  // then. Ignored for a stream that is not a link (already closed).
  void set_close_explainer(Stream& s, std::function<std::string(const std::string&)> explain);
  // Any thread: the contexts above this one, nearest first: the parent, its
  // parent, ... the root. Empty for the root. The parent says who is above
  // it (kHandleAncestors); a sibling or a context behind a child is never
  // among them, though its frames too come through the parent link.
  std::vector<std::uint32_t> ancestors() const;
  bool is_ancestor(std::uint32_t id) const;
  // Broker thread: adopts an accepted client socket. `handshake` assigns its
  // id (a ListenerHandshake); the route is added when the handshake completes.
  // Once shutdown has begun it closes the fd instead and returns nullptr.
  std::shared_ptr<Stream> add_client_stream(int fd, const std::string& name,
                                            std::unique_ptr<Handshake> handshake,
                                            ClientLinkOptions opts);
  // Client links, including those still handshaking (any thread; exact on
  // the broker thread, a snapshot elsewhere).
  std::size_t client_count() const { return clients_.load(std::memory_order_relaxed); }
  // Broker thread: client links of `uid`, handshaking ones included.
  std::size_t clients_of_uid(std::uint32_t uid) const {
    auto it = clients_by_uid_.find(uid);
    return it == clients_by_uid_.end() ? 0 : it->second;
  }
  // Any thread except the broker's after it stopped: a snapshot of the clients.
  std::vector<ClientStats> client_stats();
  // Any thread: whose share a message from `auth_id` counts against where
  // a queue divides its bounds among senders (services/lanes.h). The link
  // it came by, when that is a child's or a client's: a peer may announce
  // many contexts behind its link (ids it was allocated), and must not get
  // a share for each. Otherwise (this context, or one above or beside it,
  // through the parent) the context itself: the parent is not one sender.
  std::uint64_t fair_share_key(std::uint32_t auth_id) const { return share_key(auth_id).sender; }
  // The same, and the uid of that link's peer (this process's for a context
  // through the parent, or this one), among whose links its part is divided.
  struct ShareKey {
    std::uint64_t sender;
    std::uint32_t uid;
  };
  ShareKey share_key(std::uint32_t auth_id) const;
  // Any thread, O(1): the uid of the connected client `id`; nullopt for any
  // other context (an access check asks it on every call).
  std::optional<std::uint32_t> client_uid(std::uint32_t id) const;
  // Any thread: both contexts are routed, through the same link (the context
  // `id` lives behind the link that reaches `via`, or is `via`'s own).
  bool routed_through(std::uint32_t id, std::uint32_t via);

  // StreamListener (broker thread)
  void on_stream_open(Stream& s) override;
  void on_stream_frame(Stream& s, InFrame& f) override;
  void on_stream_message(Stream& s, Message&& m) override;
  void on_stream_batch_begin(Stream& s) override;
  void on_stream_batch_end(Stream& s) override;
  void on_stream_invalid(Stream& s, const ParseResult& r) override;
  void on_stream_refused(Stream& s, Message&& m, Refused where, const std::string& reason) override;  // fds.cpp
  void on_stream_below_mark(Stream& s) override;
  void on_stream_closed(Stream& s, const std::string& reason, Unsent unsent) override;
  // ShutdownParticipant (broker thread)
  void on_shutdown_begin() override;
  void on_shutdown_deadline() override;

 private:
  std::string still_open_summary() const;
  struct Link {
    std::shared_ptr<Stream> stream;
    StreamRole role;
    std::uint32_t remote_id = 0;
    std::string name;
    std::unordered_set<std::uint32_t> behind;   // contexts routed through this link
    std::unordered_set<std::uint32_t> egress;   // contexts this link sent to
    std::uint32_t last_egress = 0;              // egress.insert() is skipped for repeats
    // Where this link's last forwarded frame went (forward_target): a turn's
    // frames mostly share a destination. Valid while route_epoch_ is
    // unchanged, since every change of routes_ or parent_ bumps it.
    struct {
      std::uint32_t dst = 0;
      std::uint64_t epoch = 0;  // route_epoch_ starts at 1: an unused entry never matches
      Link* out = nullptr;
    } last_route;
    std::optional<ClientLinkOptions> client;    // set for a listener's clients
    Dialect dialect = Dialect::kSpindle;        // known once the handshake is done
    std::uint64_t port_serial = 0;
    bool dirty = false;                         // in dirty_: flushed at the batch's end
    // Root only: ids ALLOCATE_ID handed out for contexts behind this link and
    // not yet announced. Only this link may announce them, once; they die
    // with the link (an id whose link has gone can never be claimed).
    IdGrants allocated;
    LogBudget log_budget;
    std::function<std::string(const std::string&)> explain_close;  // set_close_explainer()
    std::uint64_t refusals = 0;                 // since the last summary line
    // Links not read until this one's output queue is under its mark again:
    // they sent it fire-and-forget frames past the mark (forward.cpp).
    std::vector<std::weak_ptr<Stream>> holding;
    std::chrono::steady_clock::time_point refusal_logged_at{};
    // fds this peer has in flight through us (released as they are written).
    std::shared_ptr<std::atomic<std::size_t>> fds_in_flight =
        std::make_shared<std::atomic<std::size_t>>(0);
    // A listener's client only (an untrusted peer): what this router keeps
    // for it beyond its messages, kRouteStateBytes for each context behind
    // it and kEgressStateBytes for each context it sent to, charged to an
    // account of its own on state_budget_ (peer_memory_limit each). Empty,
    // and never charged, for other links (our own children and parent),
    // whose routes only the per-link limit bounds.
    Charge state;
  };
  // The stream a sender on another thread charges and may write to.
  struct PortRef {
    std::shared_ptr<StreamPort> port;
    std::uint64_t serial = 0;
  };
  // The same, borrowed from the calling thread's route cache (send.cpp),
  // which owns the port: valid until this thread's next port_for(). A send
  // looks its destination up once, and no reference count is touched.
  struct PortView {
    StreamPort* port = nullptr;
    std::uint64_t serial = 0;
  };
  // Output corked for the duration of a batch, flushed at its end, also when
  // a handler throws out of it.
  class BatchScope {
   public:
    explicit BatchScope(Router& r) : r_(r) { ++r_.batch_depth_; }
    ~BatchScope() {
      if (--r_.batch_depth_ == 0) r_.flush_dirty();
    }
    BatchScope(const BatchScope&) = delete;
    BatchScope& operator=(const BatchScope&) = delete;

   private:
    Router& r_;
  };

  // send.cpp: the application threads' side and the outbox
  void submit(Header h, std::span<const std::uint8_t> bytes, Message* msg,
              std::chrono::milliseconds timeout, bool wait, std::uint32_t async_slot = 0,
              bool reply = false, bool one_way = false);
  bool deliver_here(Header& h, std::span<const std::uint8_t> bytes, Message* msg);
  PortView port_for(std::uint32_t dst);
  PortRef port_locked(std::uint32_t dst) const;  // under ports_mu_: the port, uncached
  std::size_t drain_outbox();  // records handled
  void route_local_origin(OutboxRecord& rec, std::span<const std::uint8_t> bytes, Message* msg);
  // forward.cpp: the broker thread's routing
  bool reverse_path_ok(Link& in, const Header& h);
  bool note_egress(Link& in, const Header& h);  // false: refused, with a dead reply
  Link* forward_target(Link& in, const Header& h, std::size_t body);
  void refuse_full(Link& out, const Header& h);
  // `out` is over its mark: a frame that wants an answer is refused with a
  // dead reply; any other is queued anyway and `in` is held (false: refused).
  bool over_mark(Link& in, Link& out, const Header& h, std::size_t charge);
  void release_held(Link& out);
  void forward(Link& in, InFrame& f);
  void dispatch_local(Message&& m);
  // A frame for this router from `in`: a control message, or a message for
  // a local handler (a client's request charged kCallInFlightBytes first).
  void deliver_here(Link& in, Message&& m);
  void complete_call(Message&& m);
  bool handle_control(Link& in, Message& m);  // control_handles.cpp
  // ancestors.cpp: what the parent says is above it, and telling children.
  void take_ancestors(Link& in, const Message& m);
  void tell_ancestors(Link& child);
  void tell_children_ancestors();
  void allocate_for(Message&& m);
  // Root: the next `count` ids, or fewer (at the end of the id space, or
  // where an id in use follows once it has wrapped round); nothing if no id
  // is free. Returns the first and count.
  std::optional<std::pair<std::uint32_t, std::uint32_t>> take_ids(std::uint32_t count);  // ids.cpp
  std::optional<std::pair<std::uint32_t, std::uint32_t>> take_free_ids(std::uint32_t count);
  bool id_in_use(std::uint32_t id) const;
  bool accept_add_route(Link& in, std::uint32_t target);
  // Why `in.state` refused a charge: the costs and what it and all hold.
  std::string route_state_spent(const Link& in) const;
  // Non-root: whether `id` waits in this router's block for a child of its own.
  bool holds_spare_id(std::uint32_t id);
  void forward_log(Link& in, const Message& m);
  Header dead_header(const Header& about) const;
  void send_dead(const Header& about, std::string reason);
  // For a reply that cannot be delivered: fails the call it answers, with
  // a dead reply to the caller on the callee's behalf.
  void fail_answered_call(const Header& reply, std::string reason);
  void send_internal(Message&& m);  // broker thread: control messages of ours
  void route_internal(Message&& m);
  bool enqueue_on(Link& out, Message&& m, std::size_t charged);
  // Whether a router never passes `handle` on from a child link (upwards:
  // towards its parent).
  static bool is_adjacent_only(std::uint32_t handle, bool upwards);
  // A Mitogen peer cannot decode a Spindle encoding: says why instead (a
  // dead reply to a sender that wants one, else a notice to the peer).
  void refuse_undecodable(Link& out, Message&& m);
  std::string undecodable_why(const Link& out, const Header& h) const;
  Message undecodable_notice(const Link& out, const Header& h) const;
  void flush_dirty();
  void post_flush_pass();
  void flush_pass();
  void mark_dirty(Link& l);
  void note_turn_output(Link& l);
  void flush_turn_output();
  // drops.cpp: what could not be answered, counted and logged in summary
  void note_undeliverable(const Header& h, const std::string& why);
  // A reply to a pending call from a context other than its callee (a forged
  // or misrouted reply): counted, logged at most once a second.
  void note_wrong_sender(const std::string& why);
  // A refusal of `in`'s: counted, and logged at most once a second per link.
  // A peer can make refusals as fast as it writes, so `why` is a callable
  // that makes the text: it runs only for the line that is logged, and a
  // flood of refused frames costs a counter each, not a formatted string.
  template <class MakeWhy>
    requires std::invocable<MakeWhy&>
  void note_refusal(Link& in, std::string_view kind, MakeWhy&& why) {
    if (refusal_due(in)) log_refusal(in, kind, why());
  }
  bool refusal_due(Link& in);
  void log_refusal(Link& in, std::string_view kind, const std::string& why);
  // calls.cpp
  std::exception_ptr timeout_error(std::uint32_t callee, std::chrono::milliseconds timeout) const;
  void start_request(Message msg, std::chrono::milliseconds timeout, CallTable::Completion done,
                     bool anywhere);
  void arm_deadline(std::uint32_t call_slot, Clock::time_point when);  // any thread
  void arm_call_timer();
  void set_call_timer_at(Clock::time_point at);  // broker thread
  // links.cpp
  Link* route_for(std::uint32_t dst);
  Link* link_of(const Stream& s);
  void add_route(std::uint32_t id, Link& via);
  void remove_route(std::uint32_t id);
  // Fails what waited on `ids`, fires their watchers and sends DEL_ROUTE to
  // the parent and to every link that talked to them, except `told_by`.
  // Returns the entries it visited (RouterStats::departure_steps).
  std::size_t contexts_gone(const std::vector<std::uint32_t>& ids, const std::string& reason,
                            Link* told_by = nullptr);
  void context_gone(std::uint32_t id, const std::string& reason, Link* told_by = nullptr) {
    (void)contexts_gone(std::vector<std::uint32_t>{id}, reason, told_by);
  }
  void announce(std::uint32_t handle, const std::string& payload, Link* skip,
                const std::unordered_set<Link*>& to);
  void maybe_drained();
  void release_held();
  bool hold(Message& m);
  Link& register_link(std::shared_ptr<Stream> s, StreamRole role, std::uint32_t remote_id,
                      const std::string& name);
  StreamOptions stream_options(const std::string& name) const;
  void client_opened(Link& l);
  // fds.cpp: a sender's fds and large payloads (any thread), the per-peer fd
  // quota when forwarding, and mapping a memfd body before local delivery.
  void prepare_fds_for_send(Message& msg);
  bool charge_fds(Link& in, Message& m);
  bool map_sealed_body(Message& m);
  // peer_exit.cpp: when the parent link's peer is our parent process, its
  // exit is watched with a pidfd (parent_exited()).
  void watch_parent_process(pid_t pid);

  Broker& broker_;
  RouterOptions opts_;
  std::shared_ptr<detail::RouterLink> link_ = std::make_shared<detail::RouterLink>();
  const std::uint64_t serial_;  // this router among all in the process (route caches)
  std::atomic<std::uint32_t> id_{0};
  std::atomic<std::uint32_t> next_id_{1};  // root only: the next fresh id (ids.cpp)
  // Root, broker thread: once no fresh id is left, where the search for an
  // id not in use resumes, and whether that was logged.
  std::uint32_t reuse_cursor_ = 1;
  bool ids_wrapped_ = false;
  // Root, broker thread: every link's grants (each link keeps its own too),
  // so that id_in_use() is one lookup, not one per link.
  IdGrants granted_;
  // Non-root: ids of the root's last block not used yet (allocate_id() takes
  // the lowest), so a sub-router forks most children without a round trip.
  std::mutex spare_ids_mu_;
  std::vector<std::uint32_t> spare_ids_;  // descending: back() is next
  std::atomic<bool> parent_up_{false};
  std::shared_ptr<MemoryBudget> budget_;
  std::shared_ptr<FdBudget> fd_budget_;
  // What clients make us keep beyond their messages (Link::state): a budget
  // of its own, of the same size as budget_, so that routes, which stay,
  // never crowd out the messages, which pass.
  std::shared_ptr<MemoryBudget> state_budget_;
  std::shared_ptr<BudgetRelief> relief_;
  CallTable calls_;
  Outbox outbox_;
  int wake_sink_ = 0;

  // broker thread only
  HandlerTable handlers_;
  std::unordered_map<Stream*, std::unique_ptr<Link>> links_;
  std::unordered_map<std::uint64_t, Link*> links_by_port_;
  // route_local_origin()'s last lookups (broker thread), valid for `epoch`.
  struct OriginCache {
    std::uint64_t epoch = 0;  // route_epoch_ starts at 1: a fresh cache never matches
    std::uint64_t port_serial = 0;
    Link* charged_on = nullptr;
    bool has_out = false;
    std::uint32_t dst = 0;
    Link* out = nullptr;
  } origin_cache_;
  std::atomic<std::size_t> clients_{0};
  std::unordered_map<std::uint32_t, std::size_t> clients_by_uid_;  // broker thread
  std::unordered_map<std::uint32_t, Link*> routes_;
  // For each context, the links that sent to it: told when it goes (DEL_ROUTE).
  std::unordered_map<std::uint32_t, std::unordered_set<Link*>> talkers_;
  Link* parent_ = nullptr;
  std::shared_ptr<asio::posix::stream_descriptor> parent_watch_;  // the parent's pidfd, broker thread
  std::vector<std::shared_ptr<Stream>> dirty_;
  int batch_depth_ = 0;
  bool chunk_flush_queued_ = false;  // a flush_pass() posted behind the chunk of turns under way
  std::size_t chunks_unflushed_ = 0;  // chunks of turns ended since that flush was queued
  // The stream turn under way (on_stream_batch_begin to _end): the frames it
  // delivered (past kSmallTurnFrames once it dirtied more streams than
  // turn_dirty_ holds), and the streams it made dirty while it was small. A
  // turn of at most kSmallTurnFrames (a call, a reply) writes its output at
  // its end, not at the chunk's (forward.cpp).
  static constexpr std::size_t kSmallTurnFrames = 2;
  bool in_turn_ = false;
  std::size_t turn_frames_ = 0;
  std::array<std::shared_ptr<Stream>, 4> turn_dirty_{};
  std::size_t turn_dirty_count_ = 0;
  bool shutting_down_ = false;
  asio::steady_timer call_timer_;
  // When the timer fires (max: not armed). Written by the broker thread,
  // read by others too (arm_deadline).
  std::atomic<Clock::rep> call_timer_due_{Clock::time_point::max().time_since_epoch().count()};
  bool hold_unknown_ = false;
  std::vector<Message> held_unknown_;
  std::size_t held_bytes_ = 0;
  std::unordered_set<std::uint32_t> held_handles_;  // handles with messages held
  RouterStats stats_;
  struct Drops {
    std::uint64_t count = 0;
    std::string last;
    Clock::time_point logged_at{};
  } drops_, wrong_senders_;

  // any thread: the ports application threads send through
  std::atomic<std::uint64_t> route_epoch_{1};
  mutable std::mutex ports_mu_;
  std::unordered_map<std::uint32_t, PortRef> ports_;  // guarded by ports_mu_
  PortRef parent_port_;                               // guarded by ports_mu_
  std::optional<std::uint32_t> parent_id_;            // guarded by ports_mu_
  std::vector<std::uint32_t> above_parent_;           // guarded by ports_mu_
  std::unordered_map<std::uint32_t, std::uint32_t> client_uids_;  // guarded by ports_mu_

  std::mutex disconnect_mu_;
  std::unordered_map<std::uint32_t, std::vector<std::function<void(const std::string&)>>>
      disconnect_watchers_;

  // attach_parent's handshake result
  std::promise<std::string> parent_ready_;
  bool parent_ready_set_ = false;
};

}  // namespace spindle
