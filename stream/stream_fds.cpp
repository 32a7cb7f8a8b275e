// The fd half of Stream (docs/PROTOCOL.md §13): receiving with recvmsg and
// binding each batch of fds to the SF frame it came with, framing outgoing
// messages that carry fds or a memfd body, and turning every way a message
// can lose its fds (MSG_CTRUNC, an unsealed memfd, a peer without the flag,
// a failed sendmsg) into a refusal the listener hears about, never a drop.
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <system_error>

#include <fmt/format.h>

#include "broker/errors.h"
#include "broker/log.h"
#include "broker/summary_log.h"
#include "stream/memfd.h"
#include "stream/fd_control.h"
#include "stream/fd_frame.h"
#include "stream/stream.h"

namespace spindle {

ssize_t Stream::read_once(std::span<std::uint8_t> target, bool& at_fds) {
  at_fds = false;
  const int fd = rd_.native_handle();
  if (!is_socket_) return ::read(fd, target.data(), target.size());
  FdControl control;
  iovec iov{target.data(), target.size()};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  // The process's fd budget spent, and this peer holding its share of it:
  // an untrusted peer's fds are not taken (FdBudget::admits).
  // With no room for them, the kernel closes them and says MSG_CTRUNC; the
  // bytes still arrive, and the frames they came with are refused.
  const bool refuse_fds = opts_.untrusted && opts_.fd_budget && !opts_.fd_budget->admits(*account_);
  if (!refuse_fds) control.receive_into(mh);
  ssize_t n = ::recvmsg(fd, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
  if (n < 0) return n;
  FdBatch batch;
  FdControl::for_each_received(mh, [&](int fd_in) { batch.fds.emplace_back(fd_in); });
  // MSG_CTRUNC: the kernel dropped fds (this process is at RLIMIT_NOFILE, or
  // more arrived than fit). Never ignored: the frame they belong to fails.
  batch.truncated = (mh.msg_flags & MSG_CTRUNC) != 0;
  batch.refused = refuse_fds && batch.truncated;
  if (!batch.fds.empty() || batch.truncated) {
    at_fds = true;
    stats_.fds_in += batch.fds.size();
    if (opts_.fd_budget && !batch.fds.empty())
      batch.charge = opts_.fd_budget->charge(batch.fds.size(), account_);
    rx_fds_.push_back(std::move(batch));
  }
  return n;
}

// Every complete frame has been parsed: a batch still waiting must belong to
// the one partial frame left (its first byte came with the fds). More than
// one, or one with nothing buffered, came with frames that were not SF: a
// peer could otherwise pile fds up in this process. (The fds a batch still
// owes to SF frames not yet arrived are held in batch_, at most 253.)
bool Stream::orphan_fds() const {
  return rx_fds_.size() > 1 || (rx_fds_.size() == 1 && !parser_->partial());
}

// Gives an SF frame its fds. They come from the batch SF frames are taking
// from (batch_), or else from the oldest batch received, which then becomes
// that batch: the sender passed them with the frame's first byte, and the
// kernel never returns fds later than the byte they came with, so by the
// time a frame is complete its batch has been received. A batch holds one
// frame's fds, or, with kFlagFdBatches, those of the batch head and the SF
// frames after it, bound by count (fd_frame.h).
bool Stream::bind_fds(Message& m) {
  ParseResult bad;
  bad.status = ParseStatus::kInvalid;
  bad.header = m.header;
  bad.header_valid = true;
  std::optional<FdPrefix> prefix = decode_fd_prefix(m.data, bad.error, accept_fd_extensions_, accept_fd_extensions_);
  if (!prefix) {
    protocol_error(bad);
    return false;
  }
  if (prefix->batch_head() && batch_left_ > 0)
    bad.error = fmt::format("an fd batch began while {} fds of the last were owed to frames", batch_left_);
  else if (batch_left_ == 0 && rx_fds_.empty())
    bad.error = fmt::format("SF frame declares {} fds but none arrived with it", prefix->fd_count);
  if (!bad.error.empty()) {
    protocol_error(bad);
    return false;
  }
  if (batch_left_ == 0) {
    batch_ = std::move(rx_fds_.front());
    rx_fds_.pop_front();
    bound_ = 0;
    batch_left_ = prefix->batch_head() ? prefix->batch_fds : prefix->fd_count;
    if (!batch_.truncated && batch_.fds.size() != batch_left_) {
      bad.error = fmt::format("{} declares {} fds but {} arrived with it",
                              prefix->batch_head() ? "SF batch head" : "SF frame", batch_left_,
                              batch_.fds.size());
      batch_left_ = 0;
      protocol_error(bad);
      return false;
    }
  }
  if (prefix->fd_count > batch_left_) {
    bad.error = fmt::format("SF frame declares {} fds but its batch has {} left", prefix->fd_count,
                            batch_left_);
    protocol_error(bad);
    return false;
  }
  batch_left_ -= prefix->fd_count;
  // This frame's fds: the next fd_count of the batch (fewer if the kernel
  // dropped some: only what arrived is there, in order).
  std::vector<UniqueFd> fds;
  const std::size_t have = std::min<std::size_t>(prefix->fd_count, batch_.fds.size() - bound_);
  fds.reserve(have);
  for (std::size_t i = 0; i < have; ++i) fds.push_back(std::move(batch_.fds[bound_ + i]));
  bound_ += have;
  const bool refused = batch_.refused;
  std::shared_ptr<void> charge = batch_.charge;
  if (batch_left_ == 0) {
    batch_ = {};  // used up: the next SF frame starts another
    ++batches_done_;
  }
  m.header.enc = prefix->inner_enc;
  m.data = drop_front(m.data, kFdPrefixSize);
  m.header.length = static_cast<std::uint32_t>(m.data.size());
  if (have < prefix->fd_count && refused) {
    // Not taken, on purpose (read_once): the peer is told, and this process
    // is not short of fds, so it logs nothing of its own.
    fd_closer::close_received(std::move(fds), charge);
    std::string why = fmt::format("{}: this process holds {} fds for its peers (limit {}), {} of them "
                                  "for this one; the {} sent with this message were not taken",
                                  fdreason::kFdBudgetSpent, opts_.fd_budget->held(),
                                  opts_.fd_budget->limit(), account_->fds(), prefix->fd_count);
    listener_->on_stream_refused(*this, std::move(m), StreamListener::Refused::kOnArrival, why);
    return false;
  }
  if (have < prefix->fd_count) {
    // The bytes are intact, only this frame's fds are lost (MSG_CTRUNC: the
    // kernel dropped the tail of its batch): refuse the message, keep the
    // connection (docs/PROTOCOL.md §13.4).
    fd_closer::close_received(std::move(fds), charge);  // the slots back before anything needs one
    std::string why = fmt::format("{}: {} of {} fds lost (MSG_CTRUNC) at context {} on stream {}",
                                  fdreason::kFdsLost, prefix->fd_count - have, prefix->fd_count,
                                  peer_.local_id, name());
    // This process ran out of fds: its own failure, an error whoever sent.
    // Summed up all the same: while it lasts, every frame with fds that any
    // peer sends meets it.
    static SummaryLog out_of_fds(spdlog::level::err);
    out_of_fds.note([&] {
      return fmt::format("stream={} {}; message from context {} handle {} refused", name(), why,
                         m.header.src_id, m.header.handle);
    });
    listener_->on_stream_refused(*this, std::move(m), StreamListener::Refused::kOnArrival, why);
    return false;
  }
  if (prefix->memfd_body()) {
    std::string err;
    auto body = SealedMemfd::adopt(std::move(fds.front()), err, account_, peer_charge(), charge);
    fds.erase(fds.begin());
    if (body && body->size() > opts_.max_message_size) err = too_large(body->size());
    if (body && err.empty() && prefix->memfd_range()) err = view_memfd_range(m, *body);
    if (!err.empty()) {
      std::string why = fmt::format("{}: {}", fdreason::kBadMemfd, err);
      listener_->on_stream_refused(*this, std::move(m), StreamListener::Refused::kOnArrival, why);  // it logs, at the rate it allows
      return false;
    }
    if (!prefix->memfd_range()) m.sealed_body = std::move(body);  // a range's view already holds it
  }
  // The batch's charge goes with every frame's share of it (a memfd body's
  // too): released when the last of them is gone.
  m.fds = FdSet(std::move(fds), std::move(charge));
  return true;
}

namespace {

// The bytes of `data` before its memfd range and after it (views, not
// copies), after `out`'s.
Payload bytes_around(const Payload& data, const MemfdSpan& span, Payload out = {}) {
  const std::size_t end = span.at + span.length;
  std::size_t pos = 0;
  for (const Slice& s : data.slices()) {
    const std::size_t lo = pos, hi = pos + s.size;
    if (lo < span.at) out.append(Slice{s.owner, s.data, std::min(hi, span.at) - lo});
    if (hi > end) {
      const std::size_t from = std::max(lo, end);
      out.append(Slice{s.owner, s.data + (from - lo), hi - from});
    }
    pos = hi;
  }
  return out;
}

// A ranged memfd body's inline bytes: the range descriptor, then the bytes
// around the range.
Payload memfd_range_around(const Payload& data, const MemfdSpan& span) {
  const auto desc = encode_memfd_range({span.offset, span.length, static_cast<std::uint32_t>(span.at)});
  return bytes_around(data, span, Payload::copy_of(std::span<const std::uint8_t>(desc)));
}

}  // namespace

std::string Stream::too_large(std::uint64_t size) const {
  return fmt::format("message too large: {} bytes exceeds the maximum of {}", size, opts_.max_message_size);
}

// A ranged memfd body (kFdFlagMemfdRange): `m.data` holds the descriptor and
// the bytes around the range. Mapped now (not populated: a view costs no
// page until read), since the body is no longer the memfd alone; sent on,
// the range goes as the same fd again (push_frame).
std::string Stream::view_memfd_range(Message& m, const SealedMemfd& body) {
  std::string err;
  const std::optional<MemfdRange> range = decode_memfd_range(m.data, body.size(), err);
  if (!range) return err;
  const std::size_t around_size = m.data.size() - kMemfdRangeSize;
  if (around_size + range->length > opts_.max_message_size) return too_large(around_size + range->length);
  // The bytes around are copied into the view's own pages, and the receive
  // chunk they sat in may then retire: the view carries their charge
  // instead, as the chunk did (the memfd's own is adopt()'s).
  Charge around;
  if (account_) {
    if (peer_charge() == PeerCharge::kAlways)
      account_->charge(around_size);
    else if (!account_->try_charge_within(around_size))
      return fmt::format("{} bytes around a memfd range do not fit the sender's memory allowance ({})",
                         around_size, account_->holdings());
    around = Charge(account_, around_size);
  }
  try {
    m.data = body.map_into(drop_front(m.data, kMemfdRangeSize), range->at, range->offset, range->length,
                           std::move(around));
  } catch (const std::system_error& e) {
    return e.what();
  }
  m.header.length = static_cast<std::uint32_t>(m.data.size());
  return {};
}

void Stream::refuse(Message&& m, std::size_t charged, const std::string& reason) {
  if (charged) port_->gauge.release(charged);
  m.fds = {};
  m.sealed_body.reset();
  listener_->on_stream_refused(*this, std::move(m), StreamListener::Refused::kOnSend, reason);
}

// Frames a message for this peer. A plain small message is copied into the
// byte log; a large one is queued where it lies. fds and a memfd body go in
// an SF frame if the peer takes fds; otherwise a memfd body goes inline,
// streamed from the memfd a window at a time, and fds are refused: they
// cannot be turned into bytes. The gauge ends up charged with the frame's
// whole size (the producer charged `charged` of it).
void Stream::push_frame(Message&& m, std::size_t charged) {
  const std::size_t nfds = m.fds.size();
  if (nfds > kMaxFdsPerMessage)
    return refuse(std::move(m), charged,
                  fmt::format("{}: {} exceeds the limit of {} per message", fdreason::kTooManyFds,
                              nfds, kMaxFdsPerMessage));
  // The frame's length field is 32 bits: a body (a memfd's, say) that would
  // not fit is refused here, before any length is narrowed.
  const std::uint64_t body_size = m.sealed_body ? m.sealed_body->size() : m.data.size();
  if (body_size > max_message_size())
    return refuse(std::move(m), charged,
                  fmt::format("{}: {} bytes exceeds the maximum of {} on stream {}", fdreason::kTooLarge,
                              body_size, max_message_size(), name()));
  const bool fd_peer = peer_takes_fds();
  if (nfds > 0 && !fd_peer)
    return refuse(std::move(m), charged,
                  fmt::format("{}: {} fds for context {} on stream {}", fdreason::kFdsUnsupported,
                              nfds, m.header.dst_id, name()));
  // The body goes as an fd when it is (or sits in) a sealed memfd and a slot
  // is left for it; a body of which only a range sits in one, as that range
  // with the rest inline, where the peer reads such a body.
  std::shared_ptr<const SealedMemfd> body = m.sealed_body ? m.sealed_body : m.data.memfd();
  if (body && fd_peer && nfds < kMaxFdsPerMessage) return push_fd_frame(std::move(m), charged, std::move(body));
  if (MemfdSpan span = m.data.memfd_span(); span.memfd && !m.sealed_body && fd_peer &&
                                             nfds < kMaxFdsPerMessage && span.at <= UINT32_MAX &&
                                             peer_takes_memfd_ranges())
    return push_fd_frame(std::move(m), charged, span.memfd, &span);
  if (nfds > 0) {
    // Every fd slot is taken by the message's own fds: a memfd body goes
    // inline in the SF frame (mapped, not populated).
    if (m.sealed_body) {
      try {
        m.data = m.sealed_body->map();
      } catch (const std::exception& e) {
        return refuse(std::move(m), charged, fmt::format("{}: {}", fdreason::kBadMemfd, e.what()));
      }
      m.sealed_body.reset();
    }
    return push_fd_frame(std::move(m), charged, nullptr);
  }
  TxFrame f;
  std::size_t size;
  if (m.sealed_body) {
    // Never mapped whole: streamed a window at a time (tx_queue.h).
    size = m.sealed_body->size();
    f.streamed_len = size;
    f.streamed = std::move(m.sealed_body);
  } else if (const MemfdSpan& span = m.data.memfd_span(); span.memfd && span.length > kStreamWindow) {
    // A memfd range (whole or not) goes the same way: its view is not read,
    // so the pages the peer is sent are never all mapped here at once.
    size = m.data.size();
    f.streamed_at = span.offset;
    f.streamed_len = span.length;
    f.streamed_split = span.at;
    f.body = bytes_around(m.data, span);
    f.streamed = span.memfd;
  } else {
    size = m.data.size();
  }
  m.header.length = static_cast<std::uint32_t>(size);
  const std::size_t wire = kHeaderSize + size;
  if (charged < wire) port_->gauge.charge(wire - charged);
  if (!f.streamed && size <= kInlineBodyMax) {
    tx_.append_inline(encode_header(m.header), m.data);
  } else {
    f.header = encode_header(m.header);
    if (!f.streamed) f.body = std::move(m.data);
    f.charged = wire;
    tx_.append_frame(std::move(f));
  }
  note_queued();
}

void Stream::push_fd_frame(Message&& m, std::size_t charged, std::shared_ptr<const SealedMemfd> body,
                           const MemfdSpan* range) {
  const std::size_t nfds = m.fds.size();
  std::uint16_t flags = body ? kFdFlagMemfdBody : 0;
  if (range) flags |= kFdFlagMemfdRange;
  FdPrefix prefix{m.header.enc, static_cast<std::uint16_t>(nfds + (body ? 1 : 0)), flags};
  TxFrame f;
  f.prefix = encode_fd_prefix(prefix);  // made a batch head, or not, when written (TxQueue::gather)
  f.prefixed = true;
  if (!body) f.body = m.data;
  if (range) f.body = memfd_range_around(m.data, *range);
  Header h = m.header;
  h.enc = kEncFds;
  h.length = static_cast<std::uint32_t>(f.body_size());
  f.header = encode_header(h);
  if (body) f.wire_fds.push_back(body->fd());
  for (int fd : m.fds.raw()) f.wire_fds.push_back(fd);
  f.fds_hold = m.fds;
  f.body_hold = body;
  const std::size_t wire =
      kHeaderSize + f.body_size() + (body ? body->size() : 0) + fd_charge(f.wire_fds.size());
  if (charged < wire) port_->gauge.charge(wire - charged);
  f.charged = wire;
  f.original = std::make_unique<Message>(std::move(m));
  tx_.append_frame(std::move(f));
  note_queued();
}

// sendmsg refused the fds of the frame at the head of the queue (nothing of
// it was written, and it was the only SF frame of that write: a batch is
// retried frame by frame first): that message fails alone, with the reason,
// and the rest of the queue goes on. Errors that are not about the fds close
// the stream as usual (returns false).
bool Stream::send_fd_frame_failed(int err) {
  if (err != ETOOMANYREFS && err != EMFILE && err != ENFILE && err != EINVAL && err != EBADF)
    return false;
  TxFrame f = tx_.pop_head_frame();
  std::string why = fmt::format("{}: sendmsg: {} ({} fds, stream {})", fdreason::kSendFailed,
                                errno_text(err), f.wire_fds.size(), name());
  Message m = f.original ? std::move(*f.original) : Message{decode_header(f.header.data()), {}};
  refuse(std::move(m), f.charged, why);
  return true;
}

}  // namespace spindle
