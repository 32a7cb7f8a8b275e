// Links: the streams of a router, the parent's and its children's, and what
// travels between routers about them. A child link's context is routed at
// once (messages queue while it handshakes); ADD_ROUTE announces it upwards;
// when a link closes, every context behind it is gone: pending calls to them
// fail, watchers fire, and DEL_ROUTE reaches the parent and every link that
// talked to them. Shutdown sends SHUTDOWN to children and drains every link.
#include "router/router.h"

#include <unistd.h>

#include <cstdlib>

#include <fmt/format.h>

#include "broker/errors.h"
#include "broker/log.h"
#include "router/control.h"
#include "router/reasons.h"

namespace spindle {
namespace {
// How many contexts one child link may announce with ADD_ROUTE: a bound on
// the route table a misbehaving peer can grow (docs/PROTOCOL.md, 6.2).
constexpr std::size_t kMaxRoutesPerLink = 65536;
}  // namespace

void Router::attach_parent(int read_fd, int write_fd) {
  if (broker_.on_broker_thread()) throw Error("attach_parent() would block the broker thread");
  auto ready = parent_ready_.get_future();
  broker_.defer([this, read_fd, write_fd] {
    StreamOptions so;
    so.name = "parent";
    so.max_message_size = opts_.max_message_size;
    so.high_water_mark = opts_.high_water_mark;
    so.handshake_timeout = opts_.handshake_timeout;
    std::shared_ptr<Stream> s;
    try {
      s = Stream::create(broker_, read_fd, write_fd, so,
                         std::make_unique<ClientHandshake>(static_cast<std::uint32_t>(::getpid())),
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
  StreamOptions so;
  so.name = name.empty() ? fmt::format("child-{}", child_id) : name;
  so.max_message_size = opts_.max_message_size;
  so.high_water_mark = opts_.high_water_mark;
  so.handshake_timeout = opts_.handshake_timeout;
  auto hs = std::make_unique<ServerHandshake>(
      id(), static_cast<std::uint32_t>(::getpid()), opts_.max_message_size,
      [child_id](const PeerInfo&) -> ServerHandshake::Assignment { return child_id; });
  auto s = Stream::create(broker_, read_fd, write_fd, so, std::move(hs), this);
  register_link(s, StreamRole::kChild, child_id, so.name);
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
  Link& l = *link;
  links_.emplace(s.get(), std::move(link));
  if (role == StreamRole::kParent) {
    parent_ = &l;
  } else if (remote_id != 0) {  // a client's id is known only after its handshake
    add_route(remote_id, l);
  }
  return l;
}

Router::Link* Router::link_of(const Stream& s) {
  auto it = links_.find(const_cast<Stream*>(&s));
  return it == links_.end() ? nullptr : it->second.get();
}

void Router::add_route(std::uint32_t id, Link& via) {
  routes_[id] = &via;
  via.behind.insert(id);
  {
    std::lock_guard lk(gauges_mu_);
    gauges_[id] = via.stream->gauge_ptr();
  }
  if (parent_ && &via != parent_ && parent_->stream->is_open())
    announce(kHandleAddRoute, fmt::format("{}:{}", id, via.name), nullptr, {parent_});
}

void Router::on_stream_open(Stream& s) {
  Link* l = link_of(s);
  if (!l) return;
  const PeerInfo& p = s.peer();
  if (l->role == StreamRole::kParent) {
    id_.store(p.local_id, std::memory_order_release);
    l->remote_id = p.remote_id;
    routes_[p.remote_id] = l;
    l->behind.insert(p.remote_id);
    {
      std::lock_guard lk(gauges_mu_);
      parent_id_ = p.remote_id;
      parent_gauge_ = s.gauge_ptr();
      gauges_[p.remote_id] = parent_gauge_;
    }
    parent_up_.store(true, std::memory_order_release);
    set_log_context(p.local_id, opts_.name);
    log().info("stream={} attached to parent ctx={} pid={}", s.name(), p.remote_id, p.pid);
    // Announce the children that connected before the parent link opened.
    for (auto& [sp, link] : links_)
      if (link->role == StreamRole::kChild)
        for (std::uint32_t cid : link->behind)
          announce(kHandleAddRoute, fmt::format("{}:{}", cid, link->name), nullptr, {parent_});
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

void Router::on_stream_batch_end(Stream&) { flush_dirty(); }

void Router::on_stream_invalid(Stream& s, const ParseResult& r) {
  Link* l = link_of(s);
  if (!l || !r.header_valid) return;
  Message about;
  about.header = r.header;
  // The sender is told why, on the stream it used, before the stream closes.
  if (Message::wants_dead_reply(about)) {
    Message d = Message::dead_reply(about, r.error);
    d.header.src_id = d.header.auth_id = id();
    enqueue_on(*l, std::move(d), 0);
  }
}

bool Router::handle_control(Link& in, Message& m) {
  const std::uint32_t h = m.header.handle;
  if (h != kHandleAddRoute && h != kHandleDelRoute && h != kHandleShutdown && h != kHandleForwardLog)
    return false;
  std::string text = m.text();
  if (h == kHandleForwardLog) {
    // name NUL levelno NUL message
    auto a = text.find('\0');
    auto b = a == std::string::npos ? a : text.find('\0', a + 1);
    if (b == std::string::npos) {
      log().warn("stream={} malformed FORWARD_LOG payload ({} bytes)", in.stream->name(), text.size());
      return true;
    }
    int levelno = std::atoi(text.substr(a + 1, b - a - 1).c_str());
    log().log(level_from_python(levelno), "[{}] {}", text.substr(0, a), text.substr(b + 1));
    return true;
  }
  if (h == kHandleShutdown) {
    if (&in != parent_ || m.header.src_id != in.remote_id) {
      send_dead(m, fmt::format("{}: SHUTDOWN is accepted only from the parent", reason::kRefusedByPolicy));
      return true;
    }
    log().info("stream={} parent asked this context to shut down", in.stream->name());
    broker_.shutdown();
    return true;
  }
  // ADD_ROUTE "id[:name]" / DEL_ROUTE "id"
  auto colon = text.find(':');
  auto target = parse_context_id(std::string_view(text).substr(0, colon));
  if (!target) {
    log().warn("stream={} malformed {} payload '{}'", in.stream->name(),
               h == kHandleAddRoute ? "ADD_ROUTE" : "DEL_ROUTE", text.substr(0, 64));
    return true;
  }
  if (h == kHandleAddRoute) {
    if (in.role != StreamRole::kChild) return true;  // routes are announced upwards only
    Link* cur = routes_.count(*target) ? routes_[*target] : nullptr;
    if (*target == id() || (parent_ && *target == parent_->remote_id) || (cur && cur != &in)) {
      log().warn("stream={} refused ADD_ROUTE for context {}: already routed elsewhere",
                 in.stream->name(), *target);
      return true;
    }
    // Only the root hands out ids: an id it has not allocated yet belongs to
    // no context, and announcing it would claim a future client's id.
    if (!parent_ && *target >= next_id_.load(std::memory_order_relaxed)) {
      log().warn("stream={} refused ADD_ROUTE for context {}: no such context has been allocated",
                 in.stream->name(), *target);
      return true;
    }
    // Each route costs memory: a link may announce a bounded number.
    if (!cur && in.behind.size() >= kMaxRoutesPerLink) {
      log().warn("stream={} refused ADD_ROUTE for context {}: the link already routes {} contexts "
                 "(limit {})", in.stream->name(), *target, in.behind.size(), kMaxRoutesPerLink);
      return true;
    }
    if (!cur) add_route(*target, in);
    return true;
  }
  // DEL_ROUTE
  auto it = routes_.find(*target);
  if (in.role == StreamRole::kChild) {
    if (it == routes_.end() || it->second != &in) return true;  // not theirs to delete
    remove_route(*target);
  } else if (it != routes_.end()) {
    return true;  // the parent cannot delete a route that runs through a child
  }
  context_gone(*target,
               fmt::format("{}: context {} (DEL_ROUTE from {})", reason::kPeerDisconnected, *target,
                           in.stream->name()),
               &in);
  return true;
}

void Router::remove_route(std::uint32_t id) {
  auto it = routes_.find(id);
  if (it == routes_.end()) return;
  it->second->behind.erase(id);
  routes_.erase(it);
  std::lock_guard lk(gauges_mu_);
  gauges_.erase(id);
}

void Router::context_gone(std::uint32_t gone, const std::string& why, Link* told_by) {
  fail_handlers(handlers_.take_by_respondent([gone](std::uint32_t r) { return r == gone; }), why);
  std::vector<std::function<void(const std::string&)>> watchers;
  {
    std::lock_guard lk(disconnect_mu_);
    auto it = disconnect_watchers_.find(gone);
    if (it != disconnect_watchers_.end()) {
      watchers = std::move(it->second);
      disconnect_watchers_.erase(it);
    }
  }
  for (auto& w : watchers) w(why);
  std::unordered_set<Link*> tell;
  for (auto& [s, l] : links_) {
    if (l->egress.erase(gone) && l.get() != parent_) tell.insert(l.get());
  }
  if (parent_) tell.insert(parent_);
  announce(kHandleDelRoute, std::to_string(gone), told_by, tell);
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

void Router::on_stream_closed(Stream& s, const std::string& why, std::vector<Message> unsent) {
  auto it = links_.find(&s);
  if (it == links_.end()) return;
  std::unique_ptr<Link> link = std::move(it->second);
  links_.erase(it);
  dirty_.erase(&s);
  const bool was_parent = link.get() == parent_;
  std::vector<std::uint32_t> gone(link->behind.begin(), link->behind.end());
  for (std::uint32_t id : gone) remove_route(id);
  std::string detail = fmt::format("{}: {} ({})", reason::kPeerDisconnected, link->name, why);
  if (was_parent) {
    parent_up_.store(false, std::memory_order_release);  // logs go to stderr from here on
    parent_ = nullptr;
    {
      std::lock_guard lk(gauges_mu_);
      parent_gauge_.reset();
    }
    if (!parent_ready_set_) {
      parent_ready_set_ = true;
      parent_ready_.set_value(why.empty() ? "closed" : why);
    }
    log().info("stream={} lost the parent: {}", s.name(), why);
  } else if (link->client) {
    --clients_;
    if (link->remote_id == 0)
      log().info("stream={} client pid={} uid={} dropped before its handshake completed: {}",
                 s.name(), link->client->pid, link->client->uid, why);
    else
      log().info("stream={} client ctx={} pid={} disconnected: {}", s.name(), link->remote_id,
                 link->client->pid, why);
  } else {
    log().info("stream={} child ctx={} disconnected: {}", s.name(), link->remote_id, why);
  }
  for (Message& m : unsent) send_dead(m, detail);
  for (std::uint32_t id : gone) context_gone(id, detail);
  if (was_parent) {
    // Everything not routed through a child was reached via the parent.
    fail_handlers(handlers_.take_by_respondent([this](std::uint32_t r) {
                    return r != id() && !routes_.count(r);
                  }),
                  detail);
    broker_.shutdown();  // a child does not outlive its parent link
  }
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
  for (auto& s : all) s->close("shutdown grace period over");
}

void Router::maybe_drained() {
  if (shutting_down_ && links_.empty() && !hold_unknown_) broker_.participant_drained(this);
}

}  // namespace spindle
