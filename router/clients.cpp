// Clients: the links a listening router (spindle-router) adopts from its UNIX
// socket. A client is a child-like link with three differences. Its context id
// is assigned during its handshake, so its route appears only when the
// handshake completes (until then nothing can be addressed to it). It may
// speak the Mitogen dialect, which decodes enc "MI" only: a frame in one of
// Spindle's encodings is never written to it; its sender gets a dead reply
// that says why, or, for a reply that cannot have one, the Mitogen receiver
// gets a dead message so it raises ChannelError instead of waiting forever.
// Each client acts with its own authority: its auth_id is its own context id
// (the reverse-path check makes sure of it), so a receiver can tell which
// client sent a message (docs/PROTOCOL.md §2.10).
#include <unistd.h>

#include <future>

#include <fmt/format.h>

#include "broker/log.h"
#include "broker/summary_log.h"
#include "router/reasons.h"
#include "router/router.h"

namespace spindle {

std::shared_ptr<Stream> Router::add_client_stream(int fd, const std::string& name,
                                                  std::unique_ptr<Handshake> handshake,
                                                  ClientLinkOptions opts) {
  if (shutting_down_ || broker_.state() != Broker::State::kRunning) {
    log().warn("stream={} client pid={} refused: {}", name, opts.pid, reason::kShuttingDown);
    ::close(fd);
    return nullptr;
  }
  StreamOptions so = stream_options(name);
  so.untrusted = true;  // any client may be hostile (docs/PROTOCOL.md §14)
  so.uid = opts.uid;    // its share of the budgets is its uid's
  auto s = Stream::create(broker_, fd, fd, std::move(so), std::move(handshake), this);
  Link& l = register_link(s, StreamRole::kChild, 0, name);
  l.client = opts;
  l.state = Charge(std::make_shared<Account>(opts_.peer_memory_limit, state_budget_, opts.uid), 0);
  ++clients_;
  ++clients_by_uid_[opts.uid];
  s->start();
  return s;
}

void Router::client_opened(Link& l) {
  Stream& s = *l.stream;
  const PeerInfo& p = s.peer();
  l.remote_id = p.remote_id;
  l.dialect = p.dialect;
  l.name = fmt::format("client-{}.pid{}", p.remote_id, l.client->pid);
  s.set_name(l.name);
  // A Mitogen peer decodes only "MI": every frame to it goes past the broker's
  // check (refuse_undecodable), never straight from an application thread.
  if (l.dialect == Dialect::kMitogen) s.port()->gate.close();
  l.state.add(kRouteStateBytes);  // its own route: one per client, never refused
  tell_ancestors(l);  // before anything else is routed to it
  {
    std::lock_guard lk(ports_mu_);
    client_uids_[p.remote_id] = l.client->uid;
  }
  add_route(p.remote_id, l);
  // Any local process may connect as often as it likes (links.cpp says the
  // same of its departures).
  static SummaryLog connected(spdlog::level::info, kClientLinesPerSecond);
  connected.note([&] {
    return fmt::format("stream={} client ctx={} pid={} uid={} connected ({} dialect{})", s.name(), p.remote_id,
                       l.client->pid, l.client->uid, p.dialect == Dialect::kMitogen ? "Mitogen" : "Spindle",
                       l.client->trusted ? ", same uid" : "");
  });
}

std::optional<std::uint32_t> Router::client_uid(std::uint32_t id) const {
  std::lock_guard lk(ports_mu_);
  auto it = client_uids_.find(id);
  if (it == client_uids_.end()) return std::nullopt;
  return it->second;
}

std::string Router::undecodable_why(const Link& out, const Header& h) const {
  return fmt::format("{}: enc {} (0x{:04x}) to Mitogen context {}", reason::kUndecodable, enc_name(h.enc),
                     h.enc, out.remote_id);
}

// What a Mitogen peer is told, in its terms, in place of a one-way frame it
// cannot decode: a dead message on the frame's handle.
Message Router::undecodable_notice(const Link& out, const Header& h) const {
  Message d = Message::make(h.dst_id, h.handle, Payload::copy_of(undecodable_why(out, h)), kEncMitogen);
  d.header.reply_to = kHandleIsDead;
  d.header.src_id = d.header.auth_id = id();
  return d;
}

void Router::refuse_undecodable(Link& out, Message&& m) {
  if (Message::wants_dead_reply(m) || m.is_dead()) return send_dead(m.header, undecodable_why(out, m.header));
  // Summed up, not a line per frame: a peer writes them as fast as it likes.
  note_refusal(out, "undecodable frame", [&] {
    return fmt::format("{}; telling the receiver (handle {})", undecodable_why(out, m.header), m.header.handle);
  });
  send_internal(undecodable_notice(out, m.header));
}

std::vector<ClientStats> Router::client_stats() {
  auto collect = [this] {
    std::vector<ClientStats> out;
    for (auto& [sp, l] : links_) {
      if (!l->client) continue;
      const StreamStats& st = l->stream->stats();
      ClientStats c;
      c.id = l->remote_id;
      c.name = l->name;
      c.dialect = l->dialect;
      c.pid = l->client->pid;
      c.uid = l->client->uid;
      c.messages_in = st.messages_in;
      c.messages_out = st.messages_out;
      c.bytes_in = st.bytes_in;
      c.bytes_out = st.bytes_out;
      c.writes = st.writes;
      c.queued_bytes = l->stream->gauge().queued();
      c.memory_held = l->stream->account()->held();
      c.memory_peak = l->stream->account()->peak();
      c.fds_held = l->stream->account()->fds();
      c.state_held = l->state.bytes();
      c.paused = l->stream->reading_paused();
      c.held = l->stream->held_for_peer();
      c.holds = st.peer_holds;
      out.push_back(std::move(c));
    }
    return out;
  };
  if (broker_.on_broker_thread() || broker_.state() == Broker::State::kStopped) return collect();
  std::promise<std::vector<ClientStats>> p;
  auto f = p.get_future();
  if (!broker_.try_defer([&] { p.set_value(collect()); })) return {};
  return f.get();
}

}  // namespace spindle
