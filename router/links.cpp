// Links: the streams of a router, the parent's and its children's, and the
// route table between them. A child link's context is routed at once
// (messages queue while it handshakes); ADD_ROUTE announces it upwards; when
// a link closes, every context behind it is gone: pending calls to them fail,
// watchers fire, and DEL_ROUTE reaches the parent and every link that talked
// to them. The cost of a context going away is proportional to its own ids
// and the links that talked to it (an index, talkers_), never to the number
// of links or routes. Shutdown sends SHUTDOWN to children and drains every
// link. The control handles are in control_handles.cpp.
#include "router/router.h"

#include <unistd.h>

#include <fmt/format.h>

#include "broker/errors.h"
#include "broker/log.h"
#include "broker/summary_log.h"
#include "router/control.h"
#include "router/reasons.h"

namespace spindle {

StreamOptions Router::stream_options(const std::string& name) const {
  StreamOptions so;
  so.name = name;
  so.max_message_size = opts_.max_message_size;
  so.high_water_mark = opts_.high_water_mark;
  so.handshake_timeout = opts_.handshake_timeout;
  so.memory_limit = opts_.peer_memory_limit;
  so.budget = budget_;
  so.fd_budget = fd_budget_;
  so.stall_timeout = opts_.stall_timeout;
  return so;
}

void Router::attach_parent(int read_fd, int write_fd, bool close_when_drained) {
  if (broker_.on_broker_thread()) throw Error("attach_parent() would block the broker thread");
  auto ready = parent_ready_.get_future();
  broker_.defer([this, read_fd, write_fd, close_when_drained] {
    std::shared_ptr<Stream> s;
    try {
      StreamOptions so = stream_options("parent");
      so.close_when_drained = close_when_drained;
      s = Stream::create(broker_, read_fd, write_fd, so,
                         std::make_unique<ClientHandshake>(static_cast<std::uint32_t>(::getpid()), kFlagNone,
                                                           opts_.max_message_size),
                         this);
    } catch (const std::exception& e) {  // an unusable fd: say so, don't hang the caller
      parent_ready_set_ = true;
      parent_ready_.set_value(e.what());
      return;
    }
    register_link(s, StreamRole::kParent, 0, "parent");
    s->start();
  });
  std::string err = ready.get();
  if (!err.empty()) throw Error("cannot attach to parent: " + err);
}

std::shared_ptr<Stream> Router::add_child_stream(int read_fd, int write_fd, std::uint32_t child_id,
                                                 const std::string& name) {
  if (shutting_down_ || broker_.state() != Broker::State::kRunning) {
    // No new work once shutdown has begun: the child sees EOF and exits.
    log().warn("stream={} refused: {} (child ctx={} not adopted)", name, reason::kShuttingDown, child_id);
    ::close(read_fd);
    if (write_fd != read_fd) ::close(write_fd);
    return nullptr;
  }
  StreamOptions so = stream_options(name.empty() ? fmt::format("child-{}", child_id) : name);
  auto hs = std::make_unique<ServerHandshake>(
      id(), static_cast<std::uint32_t>(::getpid()), opts_.max_message_size,
      [child_id](const PeerInfo&) -> ServerHandshake::Assignment { return child_id; });
  auto s = Stream::create(broker_, read_fd, write_fd, so, std::move(hs), this);
  // Who is above it, before anything else can be routed to it (ancestors.cpp).
  tell_ancestors(register_link(s, StreamRole::kChild, child_id, so.name));
  s->start();
  return s;
}

Router::Link& Router::register_link(std::shared_ptr<Stream> s, StreamRole role,
                                    std::uint32_t remote_id, const std::string& name) {
  auto link = std::make_unique<Link>();
  link->stream = s;
  link->role = role;
  link->remote_id = remote_id;
  link->name = name;
  link->port_serial = s->port()->serial;
  Link& l = *link;
  s->set_tag(&l);
  links_by_port_.emplace(l.port_serial, &l);
  links_.emplace(s.get(), std::move(link));
  if (role == StreamRole::kParent) {
    parent_ = &l;
    route_epoch_.fetch_add(1, std::memory_order_acq_rel);  // route_for()'s fallback changed
  } else if (remote_id != 0) {  // a client's id is known only after its handshake
    add_route(remote_id, l);
  }
  return l;
}

Router::Link* Router::link_of(const Stream& s) { return static_cast<Link*>(s.tag()); }

Router::Link* Router::route_for(std::uint32_t dst) {
  auto it = routes_.find(dst);
  if (it != routes_.end()) return it->second;
  return parent_;
}

// The ports application threads send through follow the route table; the
// epoch tells their per-thread caches that something changed.
void Router::add_route(std::uint32_t id, Link& via) {
  // A new child link over an id that another link announced: the id is the
  // new link's now, so the old one's departure must not take it away.
  // Every context behind a link was charged to it (Link::state): the caller
  // charged `via`, and the old link is given its charge back.
  Link*& route = routes_[id];
  if (route && route != &via && route->behind.erase(id)) route->state.shrink(kRouteStateBytes);
  route = &via;
  via.behind.insert(id);
  {
    std::lock_guard lk(ports_mu_);
    ports_[id] = PortRef{via.stream->port(), via.port_serial};
  }
  route_epoch_.fetch_add(1, std::memory_order_acq_rel);
  if (parent_ && &via != parent_ && parent_->stream->is_open())
    announce(kHandleAddRoute, fmt::format("{}:{}", id, via.name), nullptr, {parent_});
}

void Router::remove_route(std::uint32_t id) {
  auto it = routes_.find(id);
  if (it == routes_.end()) return;
  if (it->second->behind.erase(id)) it->second->state.shrink(kRouteStateBytes);
  routes_.erase(it);
  {
    std::lock_guard lk(ports_mu_);
    ports_.erase(id);
  }
  route_epoch_.fetch_add(1, std::memory_order_acq_rel);
}

void Router::on_stream_open(Stream& s) {
  Link* l = link_of(s);
  if (!l) return;
  // Corked, as a departure is: the announcements below go out at the end, so
  // a write that fails (and closes its stream, erasing its Link) cannot
  // happen inside the loop over links_.
  BatchScope batch(*this);
  const PeerInfo& p = s.peer();
  if (l->role == StreamRole::kParent) {
    id_.store(p.local_id, std::memory_order_release);
    l->remote_id = p.remote_id;
    routes_[p.remote_id] = l;
    l->behind.insert(p.remote_id);
    {
      std::lock_guard lk(ports_mu_);
      parent_id_ = p.remote_id;
      parent_port_ = PortRef{s.port(), l->port_serial};
      ports_[p.remote_id] = parent_port_;
    }
    route_epoch_.fetch_add(1, std::memory_order_acq_rel);
    parent_up_.store(true, std::memory_order_release);
    set_log_context(p.local_id, opts_.name);
    log().info("stream={} attached to parent ctx={} pid={}", s.name(), p.remote_id, p.pid);
    watch_parent_process(static_cast<pid_t>(p.pid));
    // Announce the children that connected before the parent link opened,
    // and tell them who is above them now.
    for (auto& [sp, link] : links_)
      if (link->role == StreamRole::kChild)
        for (std::uint32_t cid : link->behind)
          announce(kHandleAddRoute, fmt::format("{}:{}", cid, link->name), nullptr, {parent_});
    tell_children_ancestors();
    if (!parent_ready_set_) {
      parent_ready_set_ = true;
      parent_ready_.set_value({});
    }
  } else if (l->client) {
    client_opened(*l);
  } else {
    log().info("stream={} child ctx={} pid={} connected", s.name(), l->remote_id, p.pid);
  }
}

void Router::on_stream_invalid(Stream& s, const ParseResult& r) {
  Link* l = link_of(s);
  if (!l || !r.header_valid) return;
  // The sender is told why, on the stream it used, before the stream closes.
  if (r.header.reply_to != 0 && !r.header.is_dead()) {
    Message d;
    d.header = dead_header(r.header);
    d.data = Payload::copy_of(r.error);
    enqueue_on(*l, std::move(d), 0);
  }
}

std::size_t Router::contexts_gone(const std::vector<std::uint32_t>& gone, const std::string& why,
                                  Link* told_by) {
  if (gone.empty()) return 0;
  std::unordered_set<std::uint32_t> set(gone.begin(), gone.end());
  auto error = std::make_exception_ptr(ChannelError(why));
  std::size_t steps = gone.size();
  steps += calls_.fail_where([&](std::uint32_t callee) { return set.count(callee) != 0; },
                             [&](std::uint32_t) { return error; });
  for (std::uint32_t id : gone) {
    std::vector<std::function<void(const std::string&)>> watchers;
    {
      std::lock_guard lk(disconnect_mu_);
      auto it = disconnect_watchers_.find(id);
      if (it != disconnect_watchers_.end()) {
        watchers = std::move(it->second);
        disconnect_watchers_.erase(it);
      }
    }
    for (auto& w : watchers) w(why);
    // Whoever talked to it hears it is gone; the parent always does.
    std::unordered_set<Link*> tell;
    auto t = talkers_.find(id);
    if (t != talkers_.end()) {
      for (Link* l : t->second) {
        if (l->egress.erase(id)) l->state.shrink(kEgressStateBytes);
        if (l != parent_) tell.insert(l);
      }
      talkers_.erase(t);
    }
    if (parent_) tell.insert(parent_);
    steps += tell.size();
    announce(kHandleDelRoute, std::to_string(id), told_by, tell);
  }
  return steps;
}

void Router::announce(std::uint32_t handle, const std::string& payload, Link* skip,
                      const std::unordered_set<Link*>& to) {
  for (Link* l : to) {
    if (l == skip || !l->stream->accepts_output() || l->stream->state() == StreamState::kHandshaking)
      continue;
    Message m = Message::make(l->remote_id, handle, Payload::copy_of(payload), kEncMitogen);
    m.header.src_id = m.header.auth_id = id();
    enqueue_on(*l, std::move(m), 0);
  }
}

void Router::set_close_explainer(Stream& s, std::function<std::string(const std::string&)> explain) {
  if (Link* l = link_of(s)) l->explain_close = std::move(explain);
}

void Router::on_stream_closed(Stream& s, const std::string& stream_reason, Unsent unsent) {
  auto it = links_.find(&s);
  if (it == links_.end()) return;
  // Corked until the departure is fully handled. Each DEL_ROUTE and dead
  // reply below is written at the end, once per link: written at once, a
  // write to a peer that has gone too closed its stream in the middle of
  // the loop over Link pointers in announce(), which freed a Link that the
  // loop then read (a crash when several clients went at once).
  BatchScope batch(*this);
  std::unique_ptr<Link> link = std::move(it->second);
  const std::string why = link->explain_close ? link->explain_close(stream_reason) : stream_reason;
  links_.erase(it);
  links_by_port_.erase(link->port_serial);
  route_epoch_.fetch_add(1, std::memory_order_acq_rel);  // caches of the link go (route_local_origin)
  s.set_tag(nullptr);
  // Whoever waited for its queue to drain is read again (their frames for it
  // now find no route).
  release_held(*link);
  const bool was_parent = link.get() == parent_;
  std::vector<std::uint32_t> gone(link->behind.begin(), link->behind.end());
  for (std::uint32_t id : gone) remove_route(id);
  // It talks to nobody any more.
  for (std::uint32_t dst : link->egress) {
    auto t = talkers_.find(dst);
    if (t == talkers_.end()) continue;
    t->second.erase(link.get());
    if (t->second.empty()) talkers_.erase(t);
  }
  granted_.forget(link->allocated);  // its unannounced ids are free again
  std::size_t steps = gone.size() + link->egress.size() + link->allocated.blocks() +
                      unsent.wanting_reply.size() + unsent.originals.size();
  std::string detail = fmt::format("{}: {} ({})", reason::kPeerDisconnected, link->name, why);
  if (was_parent) {
    parent_up_.store(false, std::memory_order_release);  // logs go to stderr from here on
    parent_ = nullptr;
    {
      std::lock_guard lk(ports_mu_);
      parent_port_ = PortRef{};
    }
    route_epoch_.fetch_add(1, std::memory_order_acq_rel);
    if (!parent_ready_set_) {
      parent_ready_set_ = true;
      parent_ready_.set_value(why.empty() ? "closed" : why);
    }
    log().info("stream={} lost the parent: {}", s.name(), why);
  } else if (link->client) {
    --clients_;
    if (auto it = clients_by_uid_.find(link->client->uid); it != clients_by_uid_.end() && --it->second == 0)
      clients_by_uid_.erase(it);
    if (link->remote_id != 0) {
      std::lock_guard lk(ports_mu_);
      client_uids_.erase(link->remote_id);
    }
    // Any local process may connect and go as often as it likes: at most
    // kClientLinesPerSecond lines a second of each kind (SummaryLog).
    static SummaryLog dropped(spdlog::level::info, kClientLinesPerSecond);
    static SummaryLog disconnected(spdlog::level::info, kClientLinesPerSecond);
    if (link->remote_id == 0)
      dropped.note([&] {
        return fmt::format("stream={} client pid={} uid={} dropped before its handshake completed: {}", s.name(),
                           link->client->pid, link->client->uid, why);
      });
    else
      disconnected.note([&] {
        return fmt::format("stream={} client ctx={} pid={} disconnected: {}", s.name(), link->remote_id,
                           link->client->pid, why);
      });
  } else {
    log().info("stream={} child ctx={} disconnected: {}", s.name(), link->remote_id, why);
  }
  // What was queued for it: its senders are told; what needs no answer is
  // summed up in one line, however much there was.
  for (const Header& h : unsent.wanting_reply) send_dead(h, detail);
  for (auto& m : unsent.originals)
    if (Message::wants_dead_reply(*m)) send_dead(m->header, detail);
  static SummaryLog client_unsent(spdlog::level::info, kClientLinesPerSecond);
  static SummaryLog client_refusals(spdlog::level::warn, kClientLinesPerSecond);
  if (unsent.dead || unsent.other) {
    auto line = [&] {
      return fmt::format("stream={} closed with {} dead replies and {} other messages still queued for it: "
                         "dropped ({})", s.name(), unsent.dead, unsent.other, why);
    };
    if (link->client) client_unsent.note(line);
    else log().info("{}", line());
  }
  // Refusals are summed up a line a second (note_refusal): the last ones
  // would otherwise go unreported.
  if (link->refusals) {
    auto line = [&] { return fmt::format("stream={} {} more refusal(s) since the last report", s.name(), link->refusals); };
    if (link->client) client_refusals.note(line);
    else log().warn("{}", line());
  }
  steps += contexts_gone(gone, detail);
  if (was_parent) {
    // Everything not routed through a child was reached via the parent.
    auto error = std::make_exception_ptr(ChannelError(detail));
    steps += calls_.fail_where(
        [this](std::uint32_t callee) { return callee != id() && !routes_.count(callee); },
        [&](std::uint32_t) { return error; });
    broker_.shutdown();  // a child does not outlive its parent link
  }
  ++stats_.departures;
  stats_.departure_steps += steps;
  maybe_drained();
}

void Router::on_shutdown_begin() {
  shutting_down_ = true;
  // Messages held for handlers not registered yet stay held: the child's main
  // may still register them (ready() releases them, and only then is this
  // router drained). The grace deadline releases them at the latest.
  // Any write below may fail, close its stream and free its Link: hold the
  // streams and look each Link up again before using it.
  std::vector<std::shared_ptr<Stream>> streams;
  for (auto& [s, l] : links_) streams.push_back(l->stream);
  for (auto& s : streams) {
    Link* l = link_of(*s);
    if (!l || l->role != StreamRole::kChild || !s->accepts_output()) continue;
    Message m = Message::make(l->remote_id, kHandleShutdown, {}, kEncMitogen);
    m.header.src_id = m.header.auth_id = id();
    enqueue_on(*l, std::move(m), 0);
  }
  for (auto& s : streams) s->drain();
  maybe_drained();
}

void Router::on_shutdown_deadline() {
  if (hold_unknown_) {
    log().warn("shutdown deadline: main never declared ready(); answering {} held message(s)",
               held_unknown_.size());
    release_held();
  }
  std::vector<std::shared_ptr<Stream>> all;
  for (auto& [s, l] : links_) all.push_back(l->stream);
  if (!all.empty()) log().warn("{}", still_open_summary());
  for (auto& s : all) s->close("shutdown grace period over");
}

// Who kept the shutdown waiting for the whole grace: a child that never
// answered SHUTDOWN, a peer that reads nothing. Named, so that a slow close
// is a line to read and not a mystery. At most kNamed links (a router may
// have thousands of clients), then a count.
std::string Router::still_open_summary() const {
  constexpr std::size_t kNamed = 8;
  std::string out = fmt::format("shutdown grace period over: {} link(s) still open:", links_.size());
  std::size_t named = 0;
  for (const auto& [s, l] : links_) {
    if (named++ == kNamed) {
      out += fmt::format(" and {} more", links_.size() - kNamed);
      break;
    }
    out += fmt::format("{} {} {} ctx={} ({}, {} frame(s) queued)", named == 1 ? "" : ";",
                       l->role == StreamRole::kParent ? "parent" : (l->client ? "client" : "child"), l->name,
                       l->remote_id, to_string(l->stream->state()), l->stream->queued_frames());
  }
  return out + "; closing them";
}

void Router::maybe_drained() {
  // Held messages wait for main's ready() (or the deadline). With nothing
  // held, there is nothing to wait for: no link is left to bring one, so a
  // client whose router refused it (a taken name) ends at once, not after
  // the whole grace.
  if (!shutting_down_ || !links_.empty() || (hold_unknown_ && !held_unknown_.empty())) return;
  // Nothing can answer a call any more: its deadline timer must not keep a
  // hosted loop (the application's io_context) running for up to 30 s.
  call_timer_.cancel();
  set_call_timer_at(Clock::time_point::max());
  broker_.participant_drained(this);
}

bool Router::routed_through(std::uint32_t id, std::uint32_t via) {
  std::lock_guard lk(ports_mu_);
  auto a = port_locked(id).port;
  return a && a == port_locked(via).port;
}

}  // namespace spindle
