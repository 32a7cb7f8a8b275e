// What the broker thread does with a frame that arrived on a stream. A frame
// for another context is forwarded where it lies: its header checked and
// rewritten, its bytes copied straight into the destination's TxQueue (a
// large body is moved, not copied), and no Message is built. A frame for this
// context becomes a Message whose payload shares the receive chunk, and is
// dispatched by handle, or completes a pending call.
//
// Every failure is answered with a dead reply to the sender (when it asked
// for a reply), written on the sender's own stream and so charged to it.
// A dead reply carries the unreachable context as its src_id: the router
// answers on that context's behalf, and a caller accepts replies to a call
// only from its callee (docs/PROTOCOL.md §7.5).
#include <asio/post.hpp>
#include <fmt/format.h>

#include "broker/errors.h"
#include "broker/log.h"
#include "broker/summary_log.h"
#include "router/control.h"
#include "router/reasons.h"
#include "router/router.h"
#include "stream/memfd.h"

namespace spindle {

// The read batch of a stream: output is corked until its end, and, while
// other streams' turns wait in the broker's queue, until the end of that
// pass of turns (broker/input_turns.h). A turn delivers its share of the
// pass, to as many destinations as its frames name: flushed per turn, 256
// clients writing to random peers cost the router a sendmsg per frame or
// two. Flushed per pass, each destination gets one write for what every
// turn of the pass brought it. A pass is kChunksPerPass chunks (about 4,096
// frames), so that is all a frame waits; the chunks are smaller only so that
// epoll is polled more often. Flushed per chunk, 16 clients sending to each
// other cost 1,182 writes instead of 335
// (ForwardBatching.TheTurnsOfAPassLeaveInOneWritePerDestination). A stream
// busy on its own (no other turn queued) is flushed at its turn's end, as
// before.
// A small turn (a call or a reply: at most kSmallTurnFrames frames) writes
// what it queued at its end all the same: batching has nothing to gain
// there, and a round trip through a flooded router would otherwise wait a
// pass at each hop. It writes to the few streams it made dirty, never to
// every dirty one, so a client that sends one frame at a time costs the
// router a write per frame it sends, not a flush of the whole pass.
void Router::on_stream_batch_begin(Stream&) {
  if (batch_depth_++ != 0) return;
  in_turn_ = true;
  turn_frames_ = 0;
  turn_dirty_count_ = 0;
}

void Router::on_stream_batch_end(Stream&) {
  if (batch_depth_ > 0) --batch_depth_;
  if (batch_depth_ != 0) return;
  in_turn_ = false;
  if (!dirty_.empty() && broker_.input_turns().size() > 0) {
    if (turn_frames_ <= kSmallTurnFrames) flush_turn_output();
    if (!chunk_flush_queued_) {
      chunk_flush_queued_ = true;
      chunks_unflushed_ = 0;
      post_flush_pass();
    }
  } else {
    flush_dirty();
  }
  for (std::size_t i = 0; i < turn_dirty_count_; ++i) turn_dirty_[i].reset();
  turn_dirty_count_ = 0;
}

// Remembers a stream that the small turn under way made dirty. A turn that
// dirties more streams than it can remember is no longer small.
void Router::note_turn_output(Link& l) {
  for (std::size_t i = 0; i < turn_dirty_count_; ++i)
    if (turn_dirty_[i] == l.stream) return;
  if (turn_dirty_count_ == turn_dirty_.size()) {
    turn_frames_ = kSmallTurnFrames + 1;
    return;
  }
  turn_dirty_[turn_dirty_count_++] = l.stream;
}

// Writes what the small turn queued. The streams stay in dirty_ (what later
// turns of the chunk bring them goes with the chunk flush, for which this
// write leaves nothing to do). A write may close its stream: the pointers
// keep each alive until the batch's end, and flush() does nothing on a
// closed one.
void Router::flush_turn_output() {
  for (std::size_t i = 0; i < turn_dirty_count_; ++i) turn_dirty_[i]->flush();
}

// The reverse-path check: auth_id and src_id must be reachable through `in`.
// Returns false (after answering) if they are not.
bool Router::reverse_path_ok(Link& in, const Header& h) {
  for (std::uint32_t claimed : {h.auth_id, h.src_id}) {
    if (claimed == in.remote_id && claimed != id()) continue;  // the usual case: no lookup
    // Nothing arriving from outside may claim to come from this context.
    Link* expect = claimed == id() ? nullptr : route_for(claimed);
    if (expect == &in) continue;
    auto why = [&] {
      return fmt::format("{}: context {} cannot send via stream {}", reason::kReversePath, claimed,
                         in.stream->name());
    };
    note_refusal(in, reason::kReversePath, why);
    if (h.reply_to != 0 && !h.is_dead()) {
      // Back on the stream it came in on, to the id it claimed: never routed
      // to the real owner of that id.
      Message d;
      d.header = dead_header(h);
      d.data = Payload::copy_of(why());
      enqueue_on(in, std::move(d), 0);
      mark_dirty(in);
    }
    return false;
  }
  return true;
}

// Records that `in` sent to `dst`, charged to it (Link::state), so that it
// is told when `dst` goes (context_gone). When that does not fit its
// allowance, a frame that wants an answer is refused (false): a call would
// otherwise wait out its timeout for a context already gone. Any other is
// delivered, untracked: its sender hears `no route` when it next writes.
bool Router::note_egress(Link& in, const Header& h) {
  const std::uint32_t dst = h.dst_id;
  // This router never leaves its links; and only a context that exists can
  // later be gone: recording any other id would let a peer grow this set
  // without bound by writing to random ids.
  if (dst == in.last_egress || dst == id() || (!parent_ && !routes_.count(dst))) return true;
  if (!in.egress.contains(dst)) {
    if (!in.state.grow(kEgressStateBytes)) {
      auto why = [&] {
        return fmt::format("context {} cannot be told when context {} goes: {}", in.remote_id, dst,
                           route_state_spent(in));
      };
      if (h.reply_to != 0 && !h.is_dead()) {
        send_dead(h, why());
        return false;
      }
      note_refusal(in, "departure notice", why);
      return true;
    }
    in.egress.insert(dst);
    talkers_[dst].insert(&in);
  }
  in.last_egress = dst;
  return true;
}

void Router::on_stream_frame(Stream& s, InFrame& f) {
  ++turn_frames_;
  auto* in = static_cast<Link*>(s.tag());
  if (!in || !reverse_path_ok(*in, f.header) || !note_egress(*in, f.header)) return;
  if (f.header.dst_id == id()) return deliver_here(*in, f.take());
  forward(*in, f);
}

void Router::deliver_here(Link& in, Message&& m) {
  if (handle_control(in, m)) return;
  if (in.client && Message::wants_dead_reply(m)) {
    const std::shared_ptr<Account>& account = in.stream->account();
    account->charge(kCallInFlightBytes);
    m.sender_charge = std::make_shared<const Charge>(account, kCallInFlightBytes);
  }
  dispatch_local(std::move(m));
}

// Frames taken as Messages by the stream: those that carried fds.
void Router::on_stream_message(Stream& s, Message&& m) {
  ++turn_frames_;
  auto* in = static_cast<Link*>(s.tag());
  if (!in || !reverse_path_ok(*in, m.header) || !note_egress(*in, m.header)) return;
  if (m.header.dst_id == id()) return deliver_here(*in, std::move(m));
  Link* out = forward_target(*in, m.header, m.data.size() + (m.sealed_body ? m.sealed_body->size() : 0));
  if (!out || !charge_fds(*in, m)) return;
  const std::size_t charge = kHeaderSize + m.data.size() + fd_charge(m.fds.size());
  if (!out->stream->gauge().try_acquire(charge) && !over_mark(*in, *out, m.header, charge)) return;
  enqueue_on(*out, std::move(m), charge);
}

// Control handles that only the context at the other end of a link sends
// to its own router, so that a router never passes them on from below:
// routes and SHUTDOWN, and log lines other than upwards (Mitogen sends a
// context's log lines to the master through every hop).
bool Router::is_adjacent_only(std::uint32_t handle, bool upwards) {
  return handle == kHandleAddRoute || handle == kHandleDelRoute || handle == kHandleShutdown ||
         (handle == kHandleForwardLog && !upwards);
}

// Where a frame from `in` for another context goes, or null after answering
// why it cannot.
Router::Link* Router::forward_target(Link& in, const Header& h, std::size_t body) {
  const std::uint32_t dst = h.dst_id;
  // Only this thread changes the epoch: a relaxed load sees its own bumps.
  const std::uint64_t epoch = route_epoch_.load(std::memory_order_relaxed);
  Link* out;
  if (in.last_route.dst == dst && in.last_route.epoch == epoch) {
    out = in.last_route.out;
  } else {
    out = route_for(dst);
    in.last_route = {dst, epoch, out};
  }
  if (!out || out == &in) {
    send_dead(h, fmt::format("{}: {}", reason::kNoRoute, dst));
    return nullptr;
  }
  if (in.role == StreamRole::kChild && is_adjacent_only(h.handle, out == parent_)) {
    // Not passed on: a stock Mitogen peer would take a DEL_ROUTE forwarded
    // from any client as its parent's (control_handles.cpp checks ours).
    note_refusal(in, "control message", [&] {
      return fmt::format("{} (handle {} from context {} to context {})", reason::kNotAdjacent, h.handle,
                         h.src_id, dst);
    });
    if (h.reply_to != 0 && !h.is_dead()) send_dead(h, std::string(reason::kNotAdjacent));
    return nullptr;
  }
  if (opts_.unidirectional && in.role == StreamRole::kChild && out->role == StreamRole::kChild) {
    send_dead(h, fmt::format("{} (context {} to context {})", reason::kUnidirectional, h.src_id, dst));
    return nullptr;
  }
  if (body > out->stream->max_message_size()) {
    std::string why = fmt::format("{}: {} bytes exceeds the maximum of {} towards context {}",
                                  reason::kTooLarge, body, out->stream->max_message_size(), dst);
    // A reply has nobody to answer it, but its caller waits for it: that
    // call fails now, with the reason, instead of at its deadline.
    if (h.reply_to == 0 && !h.is_dead() && is_call_handle(h.handle)) fail_answered_call(h, std::move(why));
    else send_dead(h, std::move(why));
    return nullptr;
  }
  return out;
}

void Router::refuse_full(Link& out, const Header& h) {
  send_dead(h, fmt::format("{}: context {} has {} bytes queued (high-water mark {})",
                           reason::kQueueFull, h.dst_id, out.stream->gauge().queued(),
                           out.stream->gauge().high_water_mark()));
}

void Router::forward(Link& in, InFrame& f) {
  Link* out = forward_target(in, f.header, f.body_size());
  if (!out) return;
  Stream& s = *out->stream;
  if (out->dialect == Dialect::kMitogen && !mitogen_can_decode(f.header.enc) && s.accepts_output() &&
      f.header.reply_to == 0) {
    // A one-way frame the Mitogen peer cannot decode: the notice that stands
    // for it is charged on the peer's mark like the frame would be, so a
    // flood of them holds the sender, and is logged in summary.
    note_refusal(in, "undecodable frame", [&] {
      return fmt::format("{}; telling the receiver (handle {})", undecodable_why(*out, f.header),
                         f.header.handle);
    });
    Message d = undecodable_notice(*out, f.header);
    const std::size_t charge = kHeaderSize + d.data.size();
    if (!s.gauge().try_acquire(charge) && !over_mark(in, *out, d.header, charge)) return;
    enqueue_on(*out, std::move(d), charge);
    return;
  }
  if ((out->dialect == Dialect::kMitogen && !mitogen_can_decode(f.header.enc)) ||
      !s.accepts_output()) {
    Message m = f.take();
    return (void)enqueue_on(*out, std::move(m), 0);  // says why, in the peer's terms
  }
  const std::size_t charge = kHeaderSize + f.body_size();
  if (!s.gauge().try_acquire(charge) && !over_mark(in, *out, f.header, charge)) return;
  s.enqueue_frame(f.header, f, charge);
  ++stats_.routed;
  mark_dirty(*out);
}

// A destination over its high-water mark. A frame that wants an answer is
// refused: its sender hears "output queue full" at once. A frame that does
// not (a one-way message, a reply, a dead reply) could not be refused
// without being lost, since nobody would hear of it: it is queued past the
// mark (charged to the destination, whose stall rule still drops it if it
// takes nothing), and the link it came from is not read until the
// destination's queue is back under its mark. The backpressure reaches the
// sender: its frames wait in its own socket, then in its own queue, where
// its send() waits. Before, such frames were dropped and only counted, and
// a fast one-way sender through spindle-router lost messages whenever its
// receiver fell behind (bench_router's one-pair run lost up to 18,000 of
// 600,000).
bool Router::over_mark(Link& in, Link& out, const Header& h, std::size_t charge) {
  if (h.reply_to != 0 && !h.is_dead()) {
    refuse_full(out, h);
    return false;
  }
  out.stream->gauge().charge(charge);
  // Links that closed meanwhile go, so the list never outgrows the links
  // there are (a client could connect, send one frame and leave, again and
  // again, while the destination stays full).
  std::erase_if(out.holding, [](const std::weak_ptr<Stream>& w) { return w.expired(); });
  for (const auto& w : out.holding)
    if (w.lock() == in.stream) return true;  // held already, until the same release
  in.stream->hold_for_peer();
  out.holding.push_back(in.stream);
  out.stream->notify_below_mark();
  return true;
}

void Router::on_stream_below_mark(Stream& s) {
  if (auto* l = static_cast<Link*>(s.tag())) release_held(*l);
}

void Router::release_held(Link& out) {
  std::vector<std::weak_ptr<Stream>> held;
  held.swap(out.holding);
  for (const auto& w : held)
    if (auto src = w.lock()) src->release_peer_hold();
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
    send_dead(m.header, s.state() == StreamState::kClosed
                            ? fmt::format("{}: context {}", reason::kPeerDisconnected, out.remote_id)
                            : fmt::format("{}: context {} is saying goodbye", reason::kShuttingDown,
                                          out.remote_id));
    return false;
  }
  s.enqueue(std::move(m), charged);
  ++stats_.routed;
  mark_dirty(out);
  return true;
}

void Router::mark_dirty(Link& l) {
  if (batch_depth_ == 0) return l.stream->flush();
  if (in_turn_ && batch_depth_ == 1 && turn_frames_ <= kSmallTurnFrames) note_turn_output(l);
  if (!l.dirty) {
    l.dirty = true;
    dirty_.push_back(l.stream);
  }
}

// It runs after the chunk under way (whose runner posts the next one at its
// end), or after the next chunk if the turn that posted it ran outside one
// (a stream's first turn, from epoll). A hosted loop may run it after the
// router is gone (link_ says so).
void Router::post_flush_pass() {
  asio::post(broker_.io(), [this, link = link_] {
    if (!link->alive()) return;
    flush_pass();
  });
}

// At the end of a chunk: flushes unless the loop is saturated (the chunk
// stopped at its frame budget, and turns are left), in which case it waits
// for the next chunk, up to a pass of kChunksPerPass. A chunk that ran its
// round of turns under its budget is all the batching there is to have, and
// waiting longer would only delay the frames.
void Router::flush_pass() {
  const InputTurns& turns = broker_.input_turns();
  if (turns.last_chunk_was_full() && turns.size() > 0 && ++chunks_unflushed_ < InputTurns::kChunksPerPass)
    return post_flush_pass();
  chunk_flush_queued_ = false;
  flush_dirty();
}

// Writes each stream touched in the batch once. A flush may close its stream
// (and unlink it): work on a moved-out list, and skip streams gone meanwhile.
void Router::flush_dirty() {
  if (batch_depth_ > 0 || dirty_.empty()) return;
  std::vector<std::shared_ptr<Stream>> touched;
  touched.swap(dirty_);
  for (auto& s : touched) {
    if (auto* l = static_cast<Link*>(s->tag())) l->dirty = false;
    s->flush();
  }
  touched.clear();
  if (dirty_.empty()) dirty_.swap(touched);  // keep the capacity: no allocation next time
}

// A dead reply's header: to the sender's reply_to, from the context the
// message was for (on its behalf), with this router's authority.
Header Router::dead_header(const Header& about) const {
  Header d;
  d.enc = kEncMitogen;
  d.dst_id = about.src_id;
  d.src_id = about.dst_id;
  d.auth_id = id();
  d.handle = about.reply_to;
  d.reply_to = kHandleIsDead;
  return d;
}

void Router::send_dead(const Header& about, std::string why) {
  if (about.reply_to == 0 || about.is_dead()) {
    ++stats_.dropped_logged;
    note_undeliverable(about, why);
    return;
  }
  ++stats_.dead_replies;
  Message d;
  d.header = dead_header(about);
  d.data = Payload::copy_of(why);
  route_internal(std::move(d));
}

// The dead reply comes on the callee's behalf, as every dead reply does, so
// the caller's call table takes it (a callee could fail its own call anyway).
void Router::fail_answered_call(const Header& reply, std::string reason) {
  ++stats_.dead_replies;
  Message d;
  d.header = dead_header(reply);
  d.header.dst_id = reply.dst_id;  // the caller
  d.header.src_id = reply.src_id;  // the callee
  d.header.handle = reply.handle;  // the caller's call handle
  d.data = Payload::copy_of(reason);
  route_internal(std::move(d));
}

// Broker thread: a control message or dead reply of this router's own.
void Router::send_internal(Message&& m) {
  m.header.src_id = m.header.auth_id = id();
  route_internal(std::move(m));
}

void Router::route_internal(Message&& m) {
  m.header.length = static_cast<std::uint32_t>(m.data.size());
  if (m.header.dst_id == id()) {
    // Our own dead reply to our own message: completes a call or is posted
    // (no recursion through the handler that sent it).
    if (is_call_handle(m.header.handle)) return complete_call(std::move(m));
    if (!broker_.try_post([this, m = std::move(m)]() mutable { dispatch_local(std::move(m)); }))
      log().debug("dropping a message to this context at shutdown");
    return;
  }
  Link* out = route_for(m.header.dst_id);
  if (!out) {
    ++stats_.dropped_logged;
    note_undeliverable(m.header, fmt::format("{}: {}", reason::kNoRoute, m.header.dst_id));
    return;
  }
  enqueue_on(*out, std::move(m), 0);
}

void Router::complete_call(Message&& m) {
  const Header h = m.header;
  // A memfd body is mapped only for a reply some call is really waiting for.
  if (m.sealed_body && calls_.callee_of(h.handle) == h.src_id && !map_sealed_body(m)) return;
  switch (calls_.complete(h.handle, std::move(m))) {
    case CallTable::Verdict::kCompleted:
      ++stats_.delivered_locally;
      return;
    case CallTable::Verdict::kStale:
      log().debug("reply to handle {:#x} from context {} dropped: no such call is pending",
                  h.handle, h.src_id);
      return;
    case CallTable::Verdict::kWrongSender: {
      auto callee = calls_.callee_of(h.handle);
      std::string why = fmt::format("{}: handle {:#x} expects a reply from context {}, not {}",
                                    reason::kNotFromCallee, h.handle, callee ? *callee : 0,
                                    h.src_id);
      note_wrong_sender(why);
      if (h.reply_to != 0 && !h.is_dead()) send_dead(h, why);
      return;
    }
  }
}

void Router::dispatch_local(Message&& m) {
  if (is_call_handle(m.header.handle)) return complete_call(std::move(m));
  // Keep each handle's order: once a handle has messages held, later ones for
  // it queue behind them even if its handler has been registered since.
  if (hold_unknown_ && !m.is_dead() && held_handles_.count(m.header.handle) && hold(m)) return;
  const Handler* h = handlers_.find(m.header.handle);
  if (!h) {
    if (hold_unknown_ && !m.is_dead() && hold(m)) return;
    if (m.is_dead())
      log().debug("dead message for unknown handle {} from context {}", m.header.handle,
                  m.header.src_id);
    else
      send_dead(m.header, fmt::format("{}: {}", reason::kInvalidHandle, m.header.handle));
    return;
  }
  HandlerTable::Dispatch running(handlers_);  // the handler may remove itself while it runs
  if (h->opts.policy) {
    bool allowed = false;
    try {
      allowed = h->opts.policy(m);
    } catch (...) {
      // A policy that throws is a bug of the application's: the sender is
      // told its message was refused, and the exception goes on to the
      // broker loop, which logs it (the stream reads on: Stream::on_read).
      const ThrownError t = current_thrown_error();
      send_dead(m.header, fmt::format("{}: the policy of handle {} threw {}: {}", reason::kRefusedByPolicy,
                                      m.header.handle, t.type, t.message));
      throw;
    }
    if (!allowed)
      return send_dead(m.header, fmt::format("{}: handle {} refused context {}",
                                             reason::kRefusedByPolicy, m.header.handle,
                                             m.header.auth_id));
  }
  // A memfd body is mapped only now that it has somewhere to go.
  if (m.sealed_body && !map_sealed_body(m)) return;
  ++stats_.delivered_locally;
  const Header head = m.header;
  ThrownError thrown;
  try {
    h->fn(std::move(m));
    return;
  } catch (...) {
    thrown = current_thrown_error();
  }
  // The text often quotes the message it choked on, and a peer can send
  // such messages as fast as it writes (the sender gets each error in its
  // reply): escaped, and summed up.
  static SummaryLog threw;
  threw.note([&] {
    return fmt::format("handler for handle {} threw {} on a message from context {}: {:?}", head.handle,
                       thrown.type, head.src_id, thrown.message);
  });
  if (head.reply_to != 0 && !head.is_dead()) {
    Message req;
    req.header = head;
    send_internal(Message::call_error(req, thrown.type, thrown.message));
  }
}

}  // namespace spindle
