// Sending from an application thread. In steady state a send takes no lock,
// allocates nothing and wakes nobody per message, and its only atomic
// read-modify-writes are the gauge's charge and the outbox's reservation:
//  0. it is inside the runtime's link gate and the broker's producer gate
//     (broker/section_gate.h: a plain store each way);
//  1. the destination's StreamPort comes from a small per-thread cache,
//     checked against the router's route epoch (one atomic load) and
//     borrowed from it without touching its reference count; only a miss
//     (a route changed) takes ports_mu_;
//  2. the frame's bytes, and its fds (kFdCharge each), are charged to the
//     port's gauge (one CAS), waiting there only when the destination is
//     over its high-water mark;
//  3. if the stream is idle the frame is written at once, on this thread
//     (StreamPort::try_write); otherwise it is appended to the Outbox, and the
//     broker is woken only by the producer that finds no wake-up pending.
// The broker drains the outbox in one batch (drain_outbox) and writes each
// stream it touched once.
//
// A thread inside a SendBatch (api/send_batch.h) skips step 3 and the
// wake-up for its one-way sends: the batch's end wakes the broker once. It
// wakes it before any wait of its own (the gauge, a full outbox), since what
// it waits for may be its own gathered frames leaving.
//
// On the broker thread a send is routed at once (corked inside a batch).
// A message to this context itself is dispatched without a stream: a reply
// to a blocking call completes it on the sending thread, a handler that may
// run anywhere runs there, and anything else goes through the broker.
#include <atomic>
#include <memory>
#include <utility>

#include <fmt/format.h>

#include "broker/errors.h"
#include "broker/futex.h"
#include "broker/log.h"
#include "broker/summary_log.h"
#include "router/reasons.h"
#include "router/router.h"

namespace spindle {
namespace {

struct CachedRoute {
  std::uint64_t router = 0;
  std::uint64_t epoch = 0;
  std::uint32_t dst = 0;
  std::shared_ptr<StreamPort> port;
  std::uint64_t serial = 0;
};
constexpr std::size_t kRouteCacheSize = 16;
thread_local CachedRoute t_routes[kRouteCacheSize];

// A SendBatch's mark: the runtime whose one-way sends the thread gathers,
// while open. Shared, so that a batch ended on another thread (a coroutine
// resumed elsewhere, a Python generator closed by the collector) can close
// it: the thread then stops gathering instead of never waking its broker.
struct GatherMark {
  const detail::RouterLink* link;
  std::atomic<bool> open{true};
};
thread_local std::shared_ptr<GatherMark> t_gathering;

}  // namespace

Router::GatherMarks Router::gather_sends(const detail::RouterLink* link) {
  auto mine = std::make_shared<GatherMark>();
  mine->link = link;
  return {mine, std::exchange(t_gathering, mine)};
}

bool Router::end_gather(GatherMarks marks) {
  auto* mine = static_cast<GatherMark*>(marks.mine.get());
  // seq_cst: pairs with the re-check after a gathered push in submit().
  mine->open.store(false);
  auto* previous = static_cast<GatherMark*>(marks.previous.get());
  if (t_gathering.get() == mine) t_gathering = std::static_pointer_cast<GatherMark>(std::move(marks.previous));
  return previous && previous->link == mine->link && previous->open.load();
}

Router::PortView Router::port_for(std::uint32_t dst) {
  const std::uint64_t epoch = route_epoch_.load(std::memory_order_acquire);
  CachedRoute& c = t_routes[dst % kRouteCacheSize];
  if (c.router != serial_ || c.epoch != epoch || c.dst != dst) {
    PortRef p;
    {
      std::lock_guard lk(ports_mu_);
      p = port_locked(dst);
    }
    c = CachedRoute{serial_, epoch, dst, std::move(p.port), p.serial};
  }
  return PortView{c.port.get(), c.serial};
}

// What no link announced goes to the parent (if any).
Router::PortRef Router::port_locked(std::uint32_t dst) const {
  auto it = ports_.find(dst);
  return it != ports_.end() ? it->second : parent_port_;
}

void Router::send(Message msg, std::chrono::milliseconds timeout) {
  Header h = msg.header;
  submit(h, {}, &msg, timeout, true, 0, false, /*one_way=*/true);
}

void Router::send(std::uint32_t dst, std::uint32_t handle, std::span<const std::uint8_t> bytes,
                  std::uint16_t enc, std::chrono::milliseconds timeout) {
  // A payload big enough for a memfd takes the Message path, which makes one.
  if (bytes.size() >= opts_.memfd_threshold)
    return send(Message::make(dst, handle, Payload::copy_of(bytes), enc), timeout);
  Header h;
  h.enc = enc;
  h.dst_id = dst;
  h.handle = handle;
  submit(h, bytes, nullptr, timeout, true, 0, false, /*one_way=*/true);
}

void Router::route(Message msg) {
  Header h = msg.header;
  submit(h, {}, &msg, std::chrono::milliseconds(0), false);
}

void Router::post_reply(Message msg) {
  Header h = msg.header;
  try {
    submit(h, {}, &msg, kDefaultSendTimeout, false, 0, /*reply=*/true);
  } catch (const std::exception& e) {
    // Its cause is often the receiver's doing (a tiny max_message_size, a
    // full queue), as often as it calls: summed up, not a line per reply.
    static SummaryLog unsent(spdlog::level::info);
    unsent.note([&] { return fmt::format("reply to context {} handle {} not sent: {}", h.dst_id, h.handle, e.what()); });
  }
}

void Router::reply(const Message& req, Payload data, std::uint16_t enc) {
  if (req.header.reply_to == 0 || req.is_dead()) return;
  post_reply(Message::reply_to(req, std::move(data), enc));
}

// Any thread. `bytes` (the caller's, copied) or `msg` (moved from) is the body.
void Router::submit(Header h, std::span<const std::uint8_t> bytes, Message* msg,
                    std::chrono::milliseconds timeout, bool wait, std::uint32_t async_slot,
                    bool reply, bool one_way) {
  if (msg) prepare_fds_for_send(*msg);
  const std::size_t size = msg ? msg->data.size() : bytes.size();
  if (size > opts_.max_message_size)
    throw Error(fmt::format("{}: {} bytes exceeds the maximum of {}", reason::kTooLarge, size,
                            opts_.max_message_size));
  // While this guard is held the broker cannot finish without draining the
  // outbox: a frame accepted here is routed, or its sender told why not.
  Broker::ProducerGuard producing(broker_);
  if (!producing) throw ShutdownError(std::string(errtext::kBrokerShutDown));
  h.src_id = h.auth_id = id();
  h.length = static_cast<std::uint32_t>(size);
  if (msg) msg->header = h;
  const bool on_broker = broker_.on_broker_thread();
  const GatherMark* mark = t_gathering.get();
  const bool gathered = one_way && !on_broker && mark && mark->link == link_.get() &&
                        mark->open.load(std::memory_order_relaxed);
  if (h.dst_id == id() && deliver_here(h, bytes, msg)) {
    // The frame skipped the outbox, where an async call's deadline is armed.
    if (async_slot) arm_deadline(async_slot, futex::deadline_after(timeout));
    return;
  }

  const bool plain = !msg || (msg->fds.empty() && !msg->sealed_body && !msg->data.memfd_span().memfd);
  const PortView port = h.dst_id == id() ? PortView{} : port_for(h.dst_id);
  const std::size_t charge = kHeaderSize + size + (msg ? fd_charge(msg->fds.size()) : 0);
  if (port.port) {
    // The link's peer takes no more (its welcome said so): refused here, not
    // sent to become a protocol error that would close the link.
    if (const std::uint32_t most = port.port->max_message_size.load(std::memory_order_acquire); size > most)
      throw Error(fmt::format("{}: {} bytes exceeds the maximum of {} that stream {} takes (on the way to "
                              "context {})", reason::kTooLarge, size, most, port.port->name, h.dst_id));
    OutputGauge& g = port.port->gauge;
    if (reply) {
      g.charge(charge);  // the receiver asked for it: never refused, never waited for
    } else if (!g.try_acquire(charge)) {
      if (gathered) broker_.wake();  // what the gauge waits for may be this batch
      OutputGauge::Admit a = g.closed() ? OutputGauge::Admit::kClosed
                             : (!wait || on_broker)
                                 ? OutputGauge::Admit::kTimeout
                                 : g.acquire(charge, futex::deadline_after(timeout));
      if (a == OutputGauge::Admit::kTimeout)
        throw QueueFullError(fmt::format("{}: context {} has {} bytes queued (high-water mark {})",
                                         reason::kQueueFull, h.dst_id, g.queued(),
                                         g.high_water_mark()));
      if (a == OutputGauge::Admit::kClosed)
        throw ChannelError(fmt::format("{}: context {}", reason::kPeerDisconnected, h.dst_id));
    }
    // The idle stream's fast path: written here, now, in one syscall.
    if (!on_broker && !gathered && plain && outbox_.empty() && port.port->gate.direct_allowed()) {
      Payload view;
      if (msg) view = msg->data;
      else if (!bytes.empty()) view.append(Slice{nullptr, bytes.data(), bytes.size()});
      std::string error;
      switch (port.port->try_write(h, view, charge, error)) {
        case StreamPort::Direct::kWritten:
          // The reply may already be in: a call that is over is not armed.
          if (async_slot) arm_deadline(async_slot, futex::deadline_after(timeout));
          return;
        case StreamPort::Direct::kFailed:
          throw ChannelError(fmt::format("{}: context {} ({})", reason::kPeerDisconnected, h.dst_id, error));
        case StreamPort::Direct::kNotIdle: break;
      }
    }
  }
  OutboxRecord rec;
  rec.header = h;
  rec.port_serial = port.port ? port.serial : 0;
  rec.charged = port.port ? charge : 0;
  rec.call_slot = async_slot;
  if (async_slot) rec.deadline_ns = futex::deadline_after(timeout).time_since_epoch().count();
  if (on_broker) {
    // Routed at once; corked if inside a batch.
    BatchScope batch(*this);
    Message m = msg ? std::move(*msg) : Message{h, Payload::copy_of(bytes)};
    route_local_origin(rec, {}, &m);
    return;
  }
  // Small bodies travel inline in the record; the rest as a Message. The
  // Message for a large copied body is built in its branch only: a Message
  // is some 180 bytes to zero and destroy, which a local built on every
  // send made a third of this function's time per small send.
  const auto wait_at_most = reply ? kDefaultSendTimeout : wait ? timeout : std::chrono::milliseconds(0);
  // A gathering thread first tries without waiting: a full outbox may hold
  // its own batch, which the broker takes only once woken.
  auto push = [&](std::chrono::milliseconds at_most) {
    if (msg && plain && size <= kInlineBodyMax && msg->data.slices().size() == 1) {
      auto c = msg->data.contiguous();
      return outbox_.push(rec, {c.data(), c.size()}, nullptr, at_most);
    }
    if (!msg && size > kInlineBodyMax) {
      Message copied{h, Payload::copy_of(bytes)};
      return outbox_.push(rec, {}, &copied, at_most);
    }
    return outbox_.push(rec, msg ? std::span<const std::uint8_t>{} : bytes, msg, at_most);
  };
  Outbox::Push r = push(gathered ? std::chrono::milliseconds(0) : wait_at_most);
  if (r == Outbox::Push::kTimeout && gathered && wait_at_most.count() > 0) {
    broker_.wake();
    r = push(wait_at_most);
  }
  if (r != Outbox::Push::kOk) {
    if (port.port) port.port->gauge.release(charge);
    throw QueueFullError(fmt::format("{}: the send queue of this context ({} bytes) stayed full",
                                     reason::kQueueFull, outbox_.capacity()));
  }
  // A batch closed meanwhile by another thread (end_gather) may have woken
  // the broker before this record was published: either its close is seen
  // here, or its wake-up comes after the record (both sides seq_cst).
  if (!gathered) {
    broker_.wake();
  } else {
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (!mark->open.load(std::memory_order_relaxed)) broker_.wake();
  }
}

// A message to this context, sent from any thread. Returns false if it must
// go through the broker (handled there by route_local_origin).
bool Router::deliver_here(Header& h, std::span<const std::uint8_t> bytes, Message* msg) {
  auto take = [&]() -> Message {
    if (msg) return std::move(*msg);
    return Message{h, Payload::copy_of(bytes)};
  };
  if (is_call_handle(h.handle)) {
    // A reply to one of our own calls: a blocking caller, or a future, is
    // completed from here; any other async call completes on the broker
    // thread (below, via the outbox).
    if (!calls_.completes_anywhere(h.handle)) return false;
    Message m = take();
    m.header = h;
    if (calls_.complete(h.handle, std::move(m), broker_.on_broker_thread()) == CallTable::Verdict::kStale)
      log().debug("reply to handle {:#x} dropped: the call is no longer pending", h.handle);
    return true;
  }
  if (broker_.on_broker_thread()) {
    // Never recurse through the stack of the handler that sent this.
    Message m = take();
    m.header = h;
    if (!broker_.try_post([this, m = std::move(m)]() mutable { dispatch_local(std::move(m)); }))
      throw ShutdownError(std::string(errtext::kBrokerShutDown));
    return true;
  }
  HandlerPtr handler = handlers_.find_any_thread(h.handle);
  if (!handler) return false;
  Message m = take();
  m.header = h;
  if (handler->opts.policy && !handler->opts.policy(m)) return false;  // the broker refuses it
  handler->fn(std::move(m));
  return true;
}

std::size_t Router::drain_outbox() {
  BatchScope batch(*this);
  return outbox_.drain([this](OutboxRecord& rec, std::span<const std::uint8_t> bytes, Message* msg) {
    try {
      route_local_origin(rec, bytes, msg);
    } catch (const std::exception& e) {
      log().error("routing a message for context {} handle {} failed: {}", rec.header.dst_id,
                  rec.header.handle, e.what());
    }
  });
}

// Broker thread: one frame from an application thread (or this one).
void Router::route_local_origin(OutboxRecord& rec, std::span<const std::uint8_t> bytes,
                                Message* msg) {
  Header& h = rec.header;
  if (rec.call_slot) arm_deadline(rec.call_slot, Clock::time_point(Clock::duration(rec.deadline_ns)));
  auto message = [&]() -> Message {
    if (msg) return std::move(*msg);
    return Message{h, Payload::copy_of(bytes)};
  };
  auto release = [&](Link* charged_on) {
    if (!rec.charged) return;
    if (charged_on) charged_on->stream->gauge().release(rec.charged);
    rec.charged = 0;
  };
  // Consecutive records mostly share their port and destination: the last
  // lookup of each is kept while route_epoch_ is unchanged (every change
  // of the links or routes bumps it; only this thread does).
  const std::uint64_t epoch = route_epoch_.load(std::memory_order_relaxed);
  OriginCache& c = origin_cache_;
  if (c.epoch != epoch) c = OriginCache{.epoch = epoch};
  Link* charged_on = nullptr;
  if (rec.port_serial && rec.port_serial == c.port_serial) {
    charged_on = c.charged_on;
  } else if (rec.port_serial) {
    auto it = links_by_port_.find(rec.port_serial);
    if (it != links_by_port_.end()) {
      charged_on = it->second;
      c.port_serial = rec.port_serial;
      c.charged_on = charged_on;
    }
  }
  if (h.dst_id == id()) {
    release(charged_on);
    if (is_call_handle(h.handle)) return complete_call(message());
    return dispatch_local(message());
  }
  Link* out;
  if (c.has_out && c.dst == h.dst_id) {
    out = c.out;
  } else {
    out = route_for(h.dst_id);
    c.dst = h.dst_id;
    c.out = out;
    c.has_out = true;
  }
  if (!out) {
    release(charged_on);
    return send_dead(h, fmt::format("{}: {}", reason::kNoRoute, h.dst_id));
  }
  if (out != charged_on) {
    // The route changed since the sender charged (or it found none).
    release(charged_on);
    const std::size_t charge = kHeaderSize + h.length + (msg ? fd_charge(msg->fds.size()) : 0);
    if (!out->stream->gauge().try_acquire(charge))
      return send_dead(h, fmt::format("{}: context {}", reason::kQueueFull, h.dst_id));
    rec.charged = charge;
  }
  if (msg || out->dialect == Dialect::kMitogen || !out->stream->accepts_output()) {
    enqueue_on(*out, message(), rec.charged);
    return;
  }
  out->stream->enqueue_bytes(h, bytes, rec.charged);
  ++stats_.routed;
  mark_dirty(*out);
}

}  // namespace spindle
