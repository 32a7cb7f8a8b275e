// Routing runs on the broker thread. Other threads enter through two doors:
// send() charges the destination stream's OutputGauge on the caller's thread
// (that is where waiting on a full queue is allowed) and appends to an outbox
// that the broker drains in batches with one coalesced wake-up; everything
// else goes through Broker::defer(). Streams touched during a batch are
// flushed once at its end, so a burst of messages becomes one gathered write.
#include "router/router.h"

#include <cxxabi.h>
#include <unistd.h>

#include <charconv>
#include <cstdlib>

#include <fmt/format.h>

#include "broker/errors.h"
#include "broker/log.h"
#include "router/reasons.h"

namespace spindle {
namespace {

std::string demangle(const char* mangled) {
  int status = 0;
  char* s = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string out = (status == 0 && s) ? s : mangled;
  std::free(s);
  return out;
}

std::optional<std::uint32_t> parse_id(std::string_view s) {
  std::uint32_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size() || s.empty()) return std::nullopt;
  return v;
}

Message dead_message(std::string_view reason) {
  Message d = Message::make(0, 0, Payload::copy_of(reason), kEncMitogen);
  d.header.reply_to = kHandleIsDead;
  return d;
}

spdlog::level::level_enum level_from_python(int levelno) {
  if (levelno >= 50) return spdlog::level::critical;
  if (levelno >= 40) return spdlog::level::err;
  if (levelno >= 30) return spdlog::level::warn;
  if (levelno >= 20) return spdlog::level::info;
  if (levelno >= 10) return spdlog::level::debug;
  return spdlog::level::trace;
}

}  // namespace

Router::Router(Broker& broker, RouterOptions opts)
    : broker_(broker), opts_(std::move(opts)), deadline_timer_(broker.io()) {
  if (opts_.max_message_size == 0) throw Error("max_message_size must be at least 1 byte");
  broker_.defer([this] { broker_.add_participant(this); });
  // ALLOCATE_ID is answered by the root only: others forward it upwards.
  handlers_.add(
      [this](Message&& m) {
        if (parent_id()) return send_dead(m, "ALLOCATE_ID must be sent to the root context");
        reply(m, Payload::copy_of(std::to_string(next_id_.fetch_add(1))), kEncMitogen);
      },
      {}, kHandleAllocateId);
}

Router::~Router() {
  broker_.shutdown();
  if (!broker_.on_broker_thread()) broker_.join();
  // The broker thread is gone: nothing else touches our state now.
  std::vector<std::shared_ptr<Stream>> streams;
  for (auto& [s, link] : links_) streams.push_back(link->stream);
  for (auto& s : streams) s->close(std::string(reason::kShuttingDown));
  fail_handlers(handlers_.take_one_shot(), std::string(reason::kShuttingDown));
  broker_.remove_participant(this);
}

std::optional<std::uint32_t> Router::parent_id() const {
  std::lock_guard lk(const_cast<std::mutex&>(gauges_mu_));
  return parent_id_;
}

std::uint32_t Router::add_handler(HandlerFn fn, HandlerOptions opts, std::uint32_t handle) {
  std::uint32_t h = handlers_.add(std::move(fn), std::move(opts), handle);
  if (h == 0) throw Error(fmt::format("handle {} is already registered", handle));
  return h;
}

bool Router::del_handler(std::uint32_t handle) { return handlers_.take(handle) != nullptr; }

std::shared_ptr<OutputGauge> Router::gauge_for(std::uint32_t dst) {
  std::lock_guard lk(gauges_mu_);
  auto it = gauges_.find(dst);
  if (it != gauges_.end()) return it->second;
  return parent_gauge_;
}

void Router::send(Message msg, std::chrono::milliseconds timeout) {
  send_impl(std::move(msg), timeout, std::nullopt);
}

void Router::send_impl(Message msg, std::chrono::milliseconds timeout,
                       std::optional<CallDeadline> deadline) {
  const std::size_t size = msg.data.size();
  if (size > opts_.max_message_size)
    throw Error(fmt::format("{}: {} bytes exceeds the maximum of {}", reason::kTooLarge, size,
                            opts_.max_message_size));
  if (broker_.state() == Broker::State::kStopped) throw ShutdownError(std::string(errtext::kBrokerShutDown));
  msg.header.src_id = msg.header.auth_id = id();
  msg.header.length = static_cast<std::uint32_t>(size);
  const std::uint32_t dst = msg.header.dst_id;
  std::shared_ptr<OutputGauge> gauge = dst == id() ? nullptr : gauge_for(dst);
  const std::size_t charge = kHeaderSize + size;
  if (gauge) {
    // The broker thread never waits: it gets the answer the queue has now.
    OutputGauge::Admit a =
        gauge->try_acquire(charge)   ? OutputGauge::Admit::kOk
        : !broker_.on_broker_thread() ? gauge->acquire(charge, Clock::now() + timeout)
        : gauge->closed()            ? OutputGauge::Admit::kClosed
                                     : OutputGauge::Admit::kTimeout;
    if (a == OutputGauge::Admit::kTimeout)
      throw QueueFullError(fmt::format("{}: context {} has {} bytes queued (high-water mark {})",
                                       reason::kQueueFull, dst, gauge->queued(),
                                       gauge->high_water_mark()));
    if (a == OutputGauge::Admit::kClosed)
      throw ChannelError(fmt::format("{}: context {}", reason::kPeerDisconnected, dst));
  }
  bool wake;
  {
    std::lock_guard lk(outbox_mu_);
    wake = outbox_.empty();
    outbox_.push_back(Outgoing{std::move(msg), gauge, std::move(deadline)});
  }
  if (wake && !broker_.try_defer([this] { drain_outbox(); })) {
    // The broker stopped: nothing will drain the outbox, so take it back.
    std::vector<Outgoing> left;
    {
      std::lock_guard lk(outbox_mu_);
      left.swap(outbox_);
    }
    for (auto& o : left)
      if (o.gauge) o.gauge->release(kHeaderSize + o.msg.data.size());
    throw ShutdownError(std::string(errtext::kBrokerShutDown));
  }
}

// Registers a one-shot reply handler for `msg`, arms its deadline and sends
// it. `done` runs exactly once: with the reply, or with the exception a dead
// reply, CallError, timeout or disconnect turns into. Whoever removes the
// handler from the table completes the call, so these never race.
void Router::start_call(Message msg, std::chrono::milliseconds timeout, CallCompletion done) {
  const std::uint32_t dst = msg.header.dst_id;
  HandlerOptions ho;
  ho.persistent = false;
  ho.respondent = dst;
  auto shared_done = std::make_shared<CallCompletion>(std::move(done));
  std::uint32_t h = handlers_.add(
      [shared_done](Message&& reply) {
        if (reply.is_dead()) {
          (*shared_done)({}, std::make_exception_ptr(ChannelError(reply.text())));
        } else if (reply.is_call_error()) {
          CallErrorText e = parse_call_error(reply);
          (*shared_done)({}, std::make_exception_ptr(CallError(e.type, e.what)));
        } else {
          (*shared_done)(std::move(reply), nullptr);
        }
      },
      ho);
  msg.header.reply_to = h;
  CallDeadline d{Clock::now() + timeout, [this, h, shared_done, dst, timeout] {
                   if (handlers_.take(h))
                     (*shared_done)({}, std::make_exception_ptr(TimeoutError(fmt::format(
                                            "{}: no reply from context {} within {} ms",
                                            errtext::kCallTimedOut, dst, timeout.count()))));
                 }};
  try {
    send_impl(std::move(msg), timeout, std::move(d));
  } catch (...) {
    handlers_.take(h);
    throw;
  }
}

std::future<Message> Router::request(Message msg, std::chrono::milliseconds timeout) {
  auto promise = std::make_shared<std::promise<Message>>();
  auto fut = promise->get_future();
  start_call(std::move(msg), timeout, [promise](Message&& reply, std::exception_ptr err) {
    if (err) promise->set_exception(err);
    else promise->set_value(std::move(reply));
  });
  return fut;
}

// A blocking call waits on one atomic word (a futex) rather than a promise,
// which costs a second wake-up per reply.
Message Router::call(Message msg, std::chrono::milliseconds timeout) {
  if (broker_.on_broker_thread()) throw Error("call() would block the broker thread; use request()");
  struct Waiter {
    std::atomic<std::uint32_t> done{0};
    Message reply;
    std::exception_ptr error;
  };
  auto w = std::make_shared<Waiter>();
  start_call(std::move(msg), timeout, [w](Message&& reply, std::exception_ptr err) {
    w->reply = std::move(reply);
    w->error = err;
    w->done.store(1, std::memory_order_release);
    w->done.notify_one();
  });
  w->done.wait(0, std::memory_order_acquire);
  if (w->error) std::rethrow_exception(w->error);
  return std::move(w->reply);
}

void Router::arm_deadline(std::uint32_t handle, CallDeadline d) {
  auto it = deadlines_.emplace(d.when, std::make_pair(handle, std::move(d.expire)));
  deadline_of_[handle] = it;
  if (d.when < armed_for_) arm_deadline_timer(d.when);
}

void Router::arm_deadline_timer(Clock::time_point when) {
  armed_for_ = when;
  deadline_timer_.expires_at(when);  // cancels the wait armed for a later deadline
  deadline_timer_.async_wait([this](const std::error_code& ec) {
    if (ec == asio::error::operation_aborted) return;
    armed_for_ = Clock::time_point::max();
    expire_deadlines();
  });
}

void Router::cancel_deadline(std::uint32_t handle) {
  auto it = deadline_of_.find(handle);
  if (it == deadline_of_.end()) return;
  deadlines_.erase(it->second);
  deadline_of_.erase(it);
}

void Router::expire_deadlines() {
  const auto now = Clock::now();
  while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
    auto node = deadlines_.extract(deadlines_.begin());
    deadline_of_.erase(node.mapped().first);
    node.mapped().second();
  }
  if (!deadlines_.empty()) arm_deadline_timer(deadlines_.begin()->first);
}

void Router::reply(const Message& req, Payload data, std::uint16_t enc) {
  if (req.header.reply_to == 0 || req.is_dead()) return;
  send(Message::reply_to(req, std::move(data), enc));
}

void Router::on_disconnect(std::uint32_t context_id, std::function<void(const std::string&)> fn) {
  std::lock_guard lk(disconnect_mu_);
  disconnect_watchers_[context_id].push_back(std::move(fn));
}

std::uint32_t Router::allocate_id() {
  if (!parent_id()) return next_id_.fetch_add(1);
  if (broker_.on_broker_thread()) throw Error("allocate_id() would block the broker thread");
  Message reply = request(Message::make(0, kHandleAllocateId, {}, kEncMitogen),
                          std::chrono::milliseconds(10000)).get();
  auto id = parse_id(reply.text());
  if (!id) throw Error("malformed ALLOCATE_ID reply: " + reply.text());
  return *id;
}

RouterStats Router::stats() {
  auto collect = [this] {
    RouterStats s = stats_;
    s.streams = links_.size();
    s.routes = routes_.size();
    s.handlers = handlers_.size();
    return s;
  };
  if (broker_.on_broker_thread() || broker_.state() == Broker::State::kStopped) return collect();
  std::promise<RouterStats> p;
  auto f = p.get_future();
  broker_.defer([&] { p.set_value(collect()); });
  return f.get();
}

void Router::hold_unknown_handles(bool hold) {
  // After the broker stopped there is nothing to hold or release: shutdown
  // already answered whatever waited.
  broker_.try_defer([this, hold] {
    hold_unknown_ = hold;
    if (hold) return;
    std::vector<Message> held;
    held.swap(held_unknown_);
    for (Message& m : held) dispatch_local(std::move(m), nullptr);
  });
}

// ---------------------------------------------------------------- streams

void Router::attach_parent(int read_fd, int write_fd) {
  if (broker_.on_broker_thread()) throw Error("attach_parent() would block the broker thread");
  auto ready = parent_ready_.get_future();
  broker_.defer([this, read_fd, write_fd] {
    StreamOptions so;
    so.name = "parent";
    so.max_message_size = opts_.max_message_size;
    so.high_water_mark = opts_.high_water_mark;
    so.handshake_timeout = opts_.handshake_timeout;
    auto s = Stream::create(broker_, read_fd, write_fd, so,
                            std::make_unique<ClientHandshake>(static_cast<std::uint32_t>(::getpid())),
                            this);
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

void Router::register_link(std::shared_ptr<Stream> s, StreamRole role, std::uint32_t remote_id,
                           const std::string& name) {
  auto link = std::make_unique<Link>();
  link->stream = s;
  link->role = role;
  link->remote_id = remote_id;
  link->name = name;
  Link& l = *link;
  links_.emplace(s.get(), std::move(link));
  if (role == StreamRole::kParent) {
    parent_ = &l;
  } else {
    add_route(remote_id, l);
  }
}

Router::Link* Router::link_of(const Stream& s) {
  auto it = links_.find(const_cast<Stream*>(&s));
  return it == links_.end() ? nullptr : it->second.get();
}

Router::Link* Router::route_for(std::uint32_t dst) {
  auto it = routes_.find(dst);
  if (it != routes_.end()) return it->second;
  return parent_;
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

void Router::on_stream_message(Stream& s, Message&& m) {
  Link* in = link_of(s);
  if (!in) return;
  // Reverse-path check: auth_id and src_id must be reachable through `in`.
  for (std::uint32_t claimed : {m.header.auth_id, m.header.src_id}) {
    // Nothing arriving from outside may claim to come from this context.
    Link* expect = claimed == id() ? nullptr : route_for(claimed);
    if (expect != in) {
      std::string why = fmt::format("{}: context {} cannot send via stream {}", reason::kReversePath,
                                    claimed, s.name());
      log().warn("stream={} {}", s.name(), why);
      if (Message::wants_dead_reply(m)) {
        Message d = Message::dead_reply(m, why);
        d.header.src_id = d.header.auth_id = id();
        enqueue_on(*in, std::move(d), 0);
        s.flush();
      }
      return;
    }
  }
  in->egress.insert(m.header.dst_id);
  // Output is corked until the stream's read batch ends (on_stream_batch_end).
  ++batch_depth_;
  if (m.header.dst_id == id()) {
    if (!handle_control(*in, m)) dispatch_local(std::move(m), in);
  } else {
    forward(*in, std::move(m));
  }
  --batch_depth_;
}

void Router::drain_outbox() {
  std::vector<Outgoing> batch;
  {
    std::lock_guard lk(outbox_mu_);
    batch.swap(outbox_);
  }
  ++batch_depth_;
  for (Outgoing& o : batch) route_local_origin(std::move(o));
  --batch_depth_;
  flush_dirty();
}

// Writes each stream touched in the batch once. A flush may close its stream
// (and unlink it), so work from a copy and skip streams no longer linked.
void Router::flush_dirty() {
  if (batch_depth_ > 0 || dirty_.empty()) return;
  std::vector<std::shared_ptr<Stream>> touched;
  for (Stream* d : dirty_)
    if (Link* l = link_of(*d)) touched.push_back(l->stream);
  dirty_.clear();
  for (auto& s : touched) s->flush();
}

void Router::route_local_origin(Outgoing&& o) {
  Message& m = o.msg;
  if (o.deadline) arm_deadline(m.header.reply_to, std::move(*o.deadline));
  const std::size_t charge = kHeaderSize + m.data.size();
  if (m.header.dst_id == id()) {
    if (o.gauge) o.gauge->release(charge);
    return dispatch_local(std::move(m), nullptr);
  }
  Link* out = route_for(m.header.dst_id);
  if (!out) {
    if (o.gauge) o.gauge->release(charge);
    return send_dead(m, fmt::format("{}: {}", reason::kNoRoute, m.header.dst_id));
  }
  if (o.gauge != out->stream->gauge_ptr()) {
    // The route changed since the sender charged its gauge.
    if (o.gauge) o.gauge->release(charge);
    if (!out->stream->gauge().try_acquire(charge))
      return send_dead(m, fmt::format("{}: context {}", reason::kQueueFull, m.header.dst_id));
  }
  enqueue_on(*out, std::move(m), charge);
}

void Router::forward(Link& in, Message&& m) {
  const std::uint32_t dst = m.header.dst_id;
  Link* out = route_for(dst);
  if (!out || out == &in)
    return send_dead(m, fmt::format("{}: {}", reason::kNoRoute, dst));
  if (opts_.unidirectional && in.role == StreamRole::kChild && out->role == StreamRole::kChild)
    return send_dead(m, fmt::format("{} (context {} to context {})", reason::kUnidirectional,
                                    m.header.src_id, dst));
  if (m.data.size() > out->stream->max_message_size())
    return send_dead(m, fmt::format("{}: {} bytes exceeds the maximum of {} towards context {}",
                                    reason::kTooLarge, m.data.size(),
                                    out->stream->max_message_size(), dst));
  const std::size_t charge = kHeaderSize + m.data.size();
  if (!out->stream->gauge().try_acquire(charge))
    return send_dead(m, fmt::format("{}: context {} has {} bytes queued (high-water mark {})",
                                    reason::kQueueFull, dst, out->stream->gauge().queued(),
                                    out->stream->gauge().high_water_mark()));
  enqueue_on(*out, std::move(m), charge);
}

bool Router::enqueue_on(Link& out, Message&& m, std::size_t charged) {
  Stream& s = *out.stream;
  if (!s.accepts_output()) {
    if (charged) s.gauge().release(charged);
    send_dead(m, s.state() == StreamState::kClosed
                     ? fmt::format("{}: context {}", reason::kPeerDisconnected, out.remote_id)
                     : fmt::format("{}: context {} is saying goodbye", reason::kShuttingDown,
                                   out.remote_id));
    return false;
  }
  s.enqueue(std::move(m), charged);
  ++stats_.routed;
  if (batch_depth_ > 0) dirty_.insert(&s);
  else s.flush();
  return true;
}

void Router::send_internal(Message&& m) {
  m.header.src_id = m.header.auth_id = id();
  m.header.length = static_cast<std::uint32_t>(m.data.size());
  if (m.header.dst_id == id()) return dispatch_local(std::move(m), nullptr);
  Link* out = route_for(m.header.dst_id);
  if (!out) {
    ++stats_.dropped_logged;
    log().warn("dropping {} for context {} handle {}: {} {}",
               m.is_dead() ? "dead reply" : "control message", m.header.dst_id, m.header.handle,
               reason::kNoRoute, m.header.dst_id);
    return;
  }
  enqueue_on(*out, std::move(m), 0);
}

void Router::send_dead(const Message& about, std::string why) {
  if (!Message::wants_dead_reply(about)) {
    ++stats_.dropped_logged;
    // A forwarded log line carries its own text: keep it rather than lose it.
    std::string text = about.header.handle == kHandleForwardLog ? about.text() : std::string();
    for (char& c : text)
      if (c == '\0') c = ' ';
    log().warn("undeliverable message from context {} to context {} handle {} (no reply_to): {}{}{}",
               about.header.src_id, about.header.dst_id, about.header.handle, why,
               text.empty() ? "" : "; it said: ", text);
    return;
  }
  ++stats_.dead_replies;
  log().debug("dead reply to context {} handle {}: {}", about.header.src_id, about.header.reply_to,
              why);
  send_internal(Message::dead_reply(about, why));
}

void Router::dispatch_local(Message&& m, Link*) {
  ++stats_.delivered_locally;
  HandlerPtr h;
  switch (handlers_.lookup_for_dispatch(m, h)) {
    case HandlerTable::Verdict::kNotFound:
      if (hold_unknown_ && !m.is_dead() && held_unknown_.size() < kMaxHeldMessages) {
        held_unknown_.push_back(std::move(m));
        return;
      }
      if (m.is_dead())
        log().debug("dead message for unknown handle {} from context {}: {}", m.header.handle,
                    m.header.src_id, m.text());
      else
        send_dead(m, fmt::format("{}: {}", reason::kInvalidHandle, m.header.handle));
      return;
    case HandlerTable::Verdict::kWrongRespondent:
      return send_dead(m, fmt::format("{}: handle {} expects a reply, not a message from context {}",
                                      reason::kUnexpectedRespondent, m.header.handle, m.header.src_id));
    case HandlerTable::Verdict::kRefused:
      return send_dead(m, fmt::format("{}: handle {} refused context {}", reason::kRefusedByPolicy,
                                      m.header.handle, m.header.auth_id));
    case HandlerTable::Verdict::kOk:
      break;
  }
  if (!h->opts.persistent) cancel_deadline(h->handle);
  Message request_head;
  request_head.header = m.header;
  try {
    h->fn(std::move(m));
  } catch (const std::exception& e) {
    std::string type = demangle(typeid(e).name());
    log().info("handler for handle {} threw {}: {}", request_head.header.handle, type, e.what());
    if (Message::wants_dead_reply(request_head))
      send_internal(Message::call_error(request_head, type, e.what()));
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
  auto target = parse_id(std::string_view(text).substr(0, colon));
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
    if (!cur) add_route(*target, in);
    return true;
  }
  // DEL_ROUTE
  auto it = routes_.find(*target);
  if (in.role == StreamRole::kChild) {
    if (it == routes_.end() || it->second != &in) return true;  // not theirs to delete
    remove_route(*target, "route deleted by " + in.stream->name());
  } else if (it != routes_.end()) {
    return true;  // the parent cannot delete a route that runs through a child
  }
  context_gone(*target,
               fmt::format("{}: context {} (DEL_ROUTE from {})", reason::kPeerDisconnected, *target,
                           in.stream->name()),
               &in);
  return true;
}

void Router::remove_route(std::uint32_t id, const std::string&) {
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

void Router::fail_handlers(std::vector<HandlerPtr> hs, const std::string& why) {
  for (HandlerPtr& h : hs) {
    cancel_deadline(h->handle);
    try {
      h->fn(dead_message(why));
    } catch (const std::exception& e) {
      log().error("handler threw while being failed ({}): {}", why, e.what());
    }
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
  for (std::uint32_t id : gone) remove_route(id, why);
  std::string detail = fmt::format("{}: {} ({})", reason::kPeerDisconnected, link->name, why);
  if (was_parent) {
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
  hold_unknown_ = false;  // nothing more will register: answer what waited
  std::vector<Message> held;
  held.swap(held_unknown_);
  for (Message& m : held) dispatch_local(std::move(m), nullptr);
  // Any write below may fail, close its stream and free its Link: hold the
  // streams and look each Link up again before using it.
  std::vector<std::shared_ptr<Stream>> streams;
  for (auto& [s, l] : links_) streams.push_back(l->stream);
  for (auto& s : streams) {
    Link* l = link_of(*s);
    if (!l || l->role != StreamRole::kChild || !s->is_open()) continue;
    Message m = Message::make(l->remote_id, kHandleShutdown, {}, kEncMitogen);
    m.header.src_id = m.header.auth_id = id();
    enqueue_on(*l, std::move(m), 0);
  }
  for (auto& s : streams) s->drain();
  maybe_drained();
}

void Router::on_shutdown_deadline() {
  std::vector<std::shared_ptr<Stream>> all;
  for (auto& [s, l] : links_) all.push_back(l->stream);
  for (auto& s : all) s->close("shutdown grace period over");
}

void Router::maybe_drained() {
  if (shutting_down_ && links_.empty()) broker_.participant_drained(this);
}

}  // namespace spindle
