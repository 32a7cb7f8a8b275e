// Fuzzes the handshakes: the listener's (both dialects: a Spindle "SPDL"
// hello or a Mitogen 4-byte pid), and the client's (a welcome or a refusal),
// with arbitrary bytes in arbitrary reads.
//
// Checks: consume() never takes more than is buffered; what it leaves stays in
// the buffer (bytes after a handshake are the first frames); a completed
// listener handshake answers exactly a welcome (24 bytes, "SPDL") or a Mitogen
// reply (12 bytes) and reports the dialect the first byte announced; a refusal
// is a well-formed "SPNO" with a bounded reason; an invalid result carries an
// error text; and the outcome (status, error, reply bytes, peer) does not
// depend on how the bytes were split into reads.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include <fuzzer/FuzzedDataProvider.h>

#include "stream/byte_order.h"
#include "stream/listener_handshake.h"

namespace {

using namespace spindle;

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "fuzz_handshake invariant broken: %s\n", what);
  std::abort();
}

struct Outcome {
  HandshakeStatus status = HandshakeStatus::kNeedMore;
  std::string error;
  std::vector<std::uint8_t> reply;
  PeerInfo peer;
  std::size_t left = 0;  // bytes still buffered after the handshake
};

std::unique_ptr<Handshake> make(int kind, bool refuse) {
  auto assign = [refuse](const PeerInfo& p) -> ServerHandshake::Assignment {
    if (refuse) return std::string("refused for the fuzzer: pid ") + std::to_string(p.pid);
    return std::uint32_t{7};
  };
  switch (kind) {
    case 0: return std::make_unique<ListenerHandshake>(0, 4000, 1u << 20, assign);
    case 1: return std::make_unique<ServerHandshake>(0, 4000, 1u << 20, assign);
    default: return std::make_unique<ClientHandshake>(4242);
  }
}

Outcome run(int kind, bool refuse, const std::vector<std::uint8_t>& bytes,
            const std::vector<std::size_t>& cuts) {
  auto hs = make(kind, refuse);
  Outcome o;
  o.reply = hs->greeting();
  RxBuffer rx;
  std::size_t at = 0, ci = 0;
  while (at < bytes.size() && o.status == HandshakeStatus::kNeedMore) {
    std::size_t n = std::min(bytes.size() - at, ci < cuts.size() ? cuts[ci++] : bytes.size());
    auto dst = rx.write_space();
    n = std::min(n, dst.size());
    std::memcpy(dst.data(), bytes.data() + at, n);
    rx.commit(n);
    at += n;
    const std::size_t before = rx.readable();
    HandshakeResult r = hs->consume(rx, o.reply);
    if (r.consumed > before || before - rx.readable() != r.consumed)
      fail("consume() reported other than what it took off the buffer");
    o.status = r.status;
    o.error = r.error;
    if (r.status == HandshakeStatus::kInvalid && r.error.empty()) fail("invalid without a reason");
  }
  o.peer = hs->peer();
  o.left = rx.readable() + (bytes.size() - at);
  return o;
}

void check(int kind, bool refuse, const std::vector<std::uint8_t>& bytes, const Outcome& o) {
  if (kind == 2) {  // the client: its hello, then whatever the server said
    if (o.reply.size() != kHelloSize) fail("the client's reply is not just its hello");
    if (o.status == HandshakeStatus::kComplete && o.peer.local_id != be::get32(bytes.data() + 8))
      fail("client took the wrong id from the welcome");
    return;
  }
  const std::vector<std::uint8_t>& r = o.reply;
  if (o.status == HandshakeStatus::kComplete) {
    if (refuse) fail("completed although the assignment refused");
    if (o.peer.remote_id != 7) fail("completed without the assigned id");
    if (o.peer.dialect == Dialect::kMitogen) {
      if (kind != 0 || bytes[0] != 0x00) fail("Mitogen dialect without a 0x00 first byte");
      if (r.size() != kMitogenReplySize || be::get32(r.data()) != 7) fail("bad Mitogen reply");
    } else {
      if (bytes[0] != 'S') fail("Spindle dialect without an 'S' first byte");
      if (r.size() != kWelcomeSize || std::memcmp(r.data(), "SPDL", 4) != 0) fail("bad welcome");
    }
  } else if (!r.empty()) {  // only a refusal may be said before completing
    if (o.status != HandshakeStatus::kInvalid) fail("a reply while the handshake still runs");
    if (r.size() < 6 || std::memcmp(r.data(), "SPNO", 4) != 0) fail("reply is not a refusal");
    std::size_t len = be::get16(r.data() + 4);
    if (len > kMaxRefusalReason || r.size() != 6 + len) fail("malformed refusal");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  const int kind = in.ConsumeIntegralInRange<int>(0, 2);
  const bool refuse = in.ConsumeIntegralInRange<int>(0, 7) == 0;
  std::vector<std::size_t> cuts;
  for (int i = in.ConsumeIntegralInRange<int>(0, 16); i > 0; --i)
    cuts.push_back(in.ConsumeIntegralInRange<std::size_t>(1, 32));
  std::vector<std::uint8_t> bytes = in.ConsumeRemainingBytes<std::uint8_t>();
  if (bytes.empty()) return 0;

  Outcome chunked = run(kind, refuse, bytes, cuts);
  check(kind, refuse, bytes, chunked);
  Outcome whole = run(kind, refuse, bytes, {});
  if (whole.status != chunked.status || whole.error != chunked.error ||
      whole.reply != chunked.reply || whole.left != chunked.left ||
      whole.peer.remote_id != chunked.peer.remote_id || whole.peer.pid != chunked.peer.pid ||
      whole.peer.dialect != chunked.peer.dialect)
    fail("the outcome depends on how the bytes were split into reads");
  return 0;
}
