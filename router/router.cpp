// Routing runs on the broker thread. Other threads enter through two doors:
// send() charges the destination stream's OutputGauge on the caller's thread
// (that is where waiting on a full queue is allowed) and appends to an outbox
// that the broker drains in batches with one coalesced wake-up; everything
// else goes through Broker::defer(). Streams touched during a batch are
// flushed once at its end, so a burst of messages becomes one gathered write.
//
// This file holds the routing core (sending, forwarding, local dispatch and
// dead replies); calls.cpp holds request/reply matching and deadlines,
// links.cpp the streams, the control handles and disconnect propagation.
#include "router/router.h"

#include <cxxabi.h>
#include <unistd.h>

#include <cstdlib>

#include <fmt/format.h>

#include "broker/errors.h"
#include "broker/log.h"
#include "router/control.h"
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
  std::lock_guard lk(gauges_mu_);
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

void Router::route(Message msg) { send_impl(std::move(msg), std::chrono::milliseconds(0), std::nullopt); }

void Router::send_impl(Message msg, std::chrono::milliseconds timeout,
                       std::optional<CallDeadline> deadline) {
  const std::size_t size = msg.data.size();
  if (size > opts_.max_message_size)
    throw Error(fmt::format("{}: {} bytes exceeds the maximum of {}", reason::kTooLarge, size,
                            opts_.max_message_size));
  if (broker_.state() == Broker::State::kStopped) throw ShutdownError(std::string(errtext::kBrokerShutDown));
  prepare_fds_for_send(msg);
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
  auto id = parse_context_id(reply.text());
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

// Holds `m` unless that would exceed the budget (high_water_mark bytes).
bool Router::hold(Message& m) {
  std::size_t size = kHeaderSize + m.data.size();
  if (held_bytes_ + size > opts_.high_water_mark) {
    log().warn("held-message budget of {} bytes exhausted; handle {} is answered now",
               opts_.high_water_mark, m.header.handle);
    return false;
  }
  held_bytes_ += size;
  held_handles_.insert(m.header.handle);
  held_unknown_.push_back(std::move(m));
  return true;
}

void Router::release_held() {
  hold_unknown_ = false;
  std::vector<Message> held;
  held.swap(held_unknown_);
  held_bytes_ = 0;
  held_handles_.clear();
  for (Message& m : held) dispatch_local(std::move(m));
  maybe_drained();  // a router still holding was not drained
}

void Router::hold_unknown_handles(bool hold) {
  // Synchronous (inline on the broker thread), so that after ready() every
  // held message has been handled.
  // After the broker stopped there is nothing to wait for: shutdown already
  // answered whatever was held.
  std::promise<void> done;
  auto f = done.get_future();
  if (broker_.try_defer([&] {
        if (hold) hold_unknown_ = true;
        else release_held();
        done.set_value();
      }))
    f.wait();
}

Router::Link* Router::route_for(std::uint32_t dst) {
  auto it = routes_.find(dst);
  if (it != routes_.end()) return it->second;
  return parent_;
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
  if (in->client && in->client->trusted) m.header.auth_id = id();
  // Only a context that exists can later be gone: recording any other id
  // would let a peer grow this set without bound by writing to random ids.
  if (m.header.dst_id == id() || routes_.count(m.header.dst_id) || parent_)
    in->egress.insert(m.header.dst_id);
  // Output is corked until the stream's read batch ends (on_stream_batch_end).
  ++batch_depth_;
  if (m.header.dst_id == id()) {
    if (!handle_control(*in, m)) dispatch_local(std::move(m));
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
    return dispatch_local(std::move(m));
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
  if (!charge_fds(in, m)) return;
  const std::size_t charge = kHeaderSize + m.data.size();
  if (!out->stream->gauge().try_acquire(charge))
    return send_dead(m, fmt::format("{}: context {} has {} bytes queued (high-water mark {})",
                                    reason::kQueueFull, dst, out->stream->gauge().queued(),
                                    out->stream->gauge().high_water_mark()));
  enqueue_on(*out, std::move(m), charge);
}

bool Router::enqueue_on(Link& out, Message&& m, std::size_t charged) {
  Stream& s = *out.stream;
  if (out.dialect == Dialect::kMitogen && !mitogen_can_decode(m.header.enc)) {
    if (charged) s.gauge().release(charged);
    refuse_undecodable(out, std::move(m));
    return false;
  }
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
  if (m.header.dst_id == id()) return dispatch_local(std::move(m));
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

void Router::dispatch_local(Message&& m) {
  if (m.sealed_body && !map_sealed_body(m)) return;
  ++stats_.delivered_locally;
  // Keep each handle's order: once a handle has messages held, later ones for
  // it queue behind them even if its handler has been registered since.
  if (hold_unknown_ && !m.is_dead() && held_handles_.count(m.header.handle) && hold(m)) return;
  HandlerPtr h;
  switch (handlers_.lookup_for_dispatch(m, h)) {
    case HandlerTable::Verdict::kNotFound:
      if (hold_unknown_ && !m.is_dead() && hold(m)) return;
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

}  // namespace spindle
