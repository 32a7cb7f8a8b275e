// The direct write is the whole frame in one sendmsg: the header encoded on
// the stack and the payload's slices as they lie. Whatever the kernel did
// not take is handed to the broker with the gate marked kRest, so the broker
// cannot write another frame into the middle of this one; its take-over
// clears the mark. The writer lets go of the fd before it posts the rest:
// the stream may close the fd meanwhile (the rest is then dropped), and its
// destructor never waits for a task that may never run.
#include "stream/port.h"

#include <sys/socket.h>
#include <sys/uio.h>

#include <cerrno>
#include <climits>

#include <fmt/format.h>

#include "broker/errors.h"
#include "stream/tx_queue.h"

namespace spindle {
namespace {
constexpr int kMaxDirectIov = 64;
std::atomic<std::uint64_t> g_port_serial{1};
}  // namespace

StreamPort::StreamPort(std::size_t high_water_mark, std::uint32_t peer_uid)
    : serial(g_port_serial.fetch_add(1)), uid(peer_uid), gauge(high_water_mark) {}

StreamPort::Direct StreamPort::try_write(const Header& h, const Payload& body, std::size_t charged,
                                         std::string& error) {
  if (body.slices().size() + 1 > kMaxDirectIov) return Direct::kNotIdle;
  if (!gate.try_acquire_direct()) return Direct::kNotIdle;
  Header wire = h;
  wire.length = static_cast<std::uint32_t>(body.size());
  HeaderBytes hb = encode_header(wire);
  iovec iov[kMaxDirectIov];
  int cnt = 0;
  iov[cnt++] = {hb.data(), kHeaderSize};
  for (const Slice& s : body.slices()) iov[cnt++] = {const_cast<std::uint8_t*>(s.data), s.size};
  msghdr mh{};
  mh.msg_iov = iov;
  mh.msg_iovlen = static_cast<std::size_t>(cnt);
  ssize_t n;
  do {
    n = ::sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
  } while (n < 0 && errno == EINTR);
  const std::size_t total = kHeaderSize + body.size();
  gate.note_direct_write();
  if (n >= 0 && static_cast<std::size_t>(n) == total) {
    gauge.release(charged);
    direct_writes.fetch_add(1, std::memory_order_relaxed);
    if (gate.release_direct()) hand_over(nullptr, {});
    return Direct::kWritten;
  }
  if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
    int err = errno;
    error = err == EPIPE || err == ECONNRESET
                ? fmt::format("peer closed the connection ({})", errno_text(err))
                : fmt::format("write: {}", errno_text(err));
    gauge.release(charged);
    gate.release_direct();
    hand_over(nullptr, error);  // the broker closes the stream
    return Direct::kFailed;
  }
  // The socket took part of it (or none): the broker writes the rest, first.
  TxFrame rest;
  rest.header = hb;
  // A slice without an owner is the caller's memory, valid only during this
  // call: the rest that outlives it is copied (this path is rare: the
  // socket was full).
  bool borrowed = false;
  for (const Slice& s : body.slices()) borrowed = borrowed || !s.owner;
  rest.body = borrowed ? body.owned_copy() : body;
  rest.charged = charged;
  rest.skip = n > 0 ? static_cast<std::size_t>(n) : 0;
  direct_writes.fetch_add(1, std::memory_order_relaxed);
  // Let go of the fd before posting: the broker's take-over clears kRest,
  // and it may run before hand_over returns.
  gate.hand_over_rest();
  hand_over(&rest, {});
  return Direct::kWritten;
}

}  // namespace spindle
