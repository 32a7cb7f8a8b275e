// Tests for stream/handshake.h: ClientHandshake / ServerHandshake driven over
// an RxBuffer, without sockets.
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "stream/handshake.h"
#include "stream/listener_handshake.h"
#include "stream/rx_buffer.h"

// Everything here lives in namespace test_handshake, so that the unity build (scripts/test.sh)
// can put this file in one translation unit with other tests.
namespace test_handshake {

using namespace spindle;


using Bytes = std::vector<std::uint8_t>;

void push(RxBuffer& rx, std::span<const std::uint8_t> b) {
  while (!b.empty()) {
    auto dst = rx.write_space();
    std::size_t n = std::min(dst.size(), b.size());
    std::memcpy(dst.data(), b.data(), n);
    rx.commit(n);
    b = b.subspan(n);
  }
}

void push(RxBuffer& rx, std::string_view s) {
  push(rx, std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(s.data()),
                                         s.size()));
}

Bytes drain(RxBuffer& rx) {
  Bytes out(rx.readable());
  rx.read_into(out.data(), out.size());
  return out;
}

Bytes concat(Bytes a, const Bytes& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

std::uint32_t be32(const Bytes& b, std::size_t off) {
  return (std::uint32_t{b[off]} << 24) | (std::uint32_t{b[off + 1]} << 16) |
         (std::uint32_t{b[off + 2]} << 8) | std::uint32_t{b[off + 3]};
}
std::uint16_t be16(const Bytes& b, std::size_t off) {
  return static_cast<std::uint16_t>((b[off] << 8) | b[off + 1]);
}

bool starts_with(const Bytes& b, std::string_view s) {
  return b.size() >= s.size() && std::memcmp(b.data(), s.data(), s.size()) == 0;
}

constexpr std::uint32_t kServerId = 0;
constexpr std::uint32_t kServerPid = 0x0a0b0c0d;
constexpr std::uint32_t kMax = 64u << 20;

struct ServerFixture {
  int assign_calls = 0;
  std::optional<PeerInfo> seen;
  ServerHandshake::Assignment answer = std::uint32_t{42};
  ServerHandshake server{kServerId, kServerPid, kMax, [this](const PeerInfo& hello) {
                           ++assign_calls;
                           seen = hello;
                           return answer;
                         }};
};


TEST(HandshakeTest, ClientGreetingIsExactHello) {
  ClientHandshake client(0x01020304, 0x0503);
  Bytes g = client.greeting();
  const Bytes expected = {'S', 'P', 'D', 'L', 0x00, 0x01, 0x05, 0x03, 0x01, 0x02, 0x03, 0x04};
  EXPECT_EQ(g, expected);
  EXPECT_EQ(g.size(), kHelloSize);
  EXPECT_EQ(g, encode_hello(kProtocolVersion, 0x0503, 0x01020304));

  ClientHandshake plain(77);
  EXPECT_EQ(plain.greeting(),
            (Bytes{'S', 'P', 'D', 'L', 0x00, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 77}));
}

// A client with a maximum message size announces it after its pid.
TEST(HandshakeTest, AClientsHelloCarriesItsMaximum) {
  ClientHandshake client(77, kFlagFdPassing, 0x00010203);
  const Bytes g = client.greeting();
  EXPECT_EQ(g, (Bytes{'S', 'P', 'D', 'L', 0x00, 0x01, 0x00, 0x05, 0x00, 0x00, 0x00, 77,
                      0x00, 0x01, 0x02, 0x03}));
  EXPECT_EQ(g.size(), kHelloSize + kHelloLimitSize);
  EXPECT_EQ(g, encode_hello(kProtocolVersion, kFlagFdPassing | kFlagMaxMessageSize, 77, 0x00010203));
}

// The server waits for the 4 more bytes the flag promises, and keeps the
// client's limit (the stream then sends at most the lower of the two).
TEST(HandshakeTest, TheServerReadsTheClientsMaximumByteByByte) {
  ServerFixture f;
  RxBuffer rx;
  const Bytes hello = encode_hello(kProtocolVersion, kFlagMaxMessageSize, 4242, 65536);
  Bytes reply;
  for (std::size_t i = 0; i < hello.size(); ++i) {
    push(rx, std::span<const std::uint8_t>(&hello[i], 1));
    HandshakeResult r = f.server.consume(rx, reply);
    if (i + 1 < hello.size()) {
      ASSERT_EQ(r.status, HandshakeStatus::kNeedMore) << "after " << i + 1 << " bytes: " << r.error;
      EXPECT_EQ(r.consumed, 0u);
      EXPECT_EQ(f.assign_calls, 0);
    } else {
      ASSERT_EQ(r.status, HandshakeStatus::kComplete) << r.error;
      EXPECT_EQ(r.consumed, kHelloSize + kHelloLimitSize);
    }
  }
  EXPECT_EQ(rx.readable(), 0u);
  EXPECT_EQ(f.server.peer().max_message_size, 65536u);
  ASSERT_TRUE(f.seen);
  EXPECT_EQ(f.seen->max_message_size, 65536u);
  EXPECT_EQ(reply, encode_welcome(kFlagNone, 42, kServerId, kServerPid, kMax));

  // Without the flag the peer's limit is the server's own.
  ServerFixture old;
  RxBuffer orx;
  push(orx, encode_hello(kProtocolVersion, kFlagNone, 4242));
  Bytes oreply;
  ASSERT_EQ(old.server.consume(orx, oreply).status, HandshakeStatus::kComplete);
  EXPECT_EQ(old.server.peer().max_message_size, kMax);
}

TEST(HandshakeTest, AHelloThatAnnouncesAZeroMaximumIsRefused) {
  ServerFixture f;
  RxBuffer rx;
  push(rx, encode_hello(kProtocolVersion, kFlagMaxMessageSize, 4242, 0));
  Bytes reply;
  HandshakeResult r = f.server.consume(rx, reply);
  ASSERT_EQ(r.status, HandshakeStatus::kInvalid);
  EXPECT_EQ(r.error, "the hello announces a maximum message size of 0 bytes");
  EXPECT_EQ(reply, encode_refusal(r.error));
  EXPECT_EQ(f.assign_calls, 0);
}

TEST(HandshakeTest, ServerGreetingIsEmpty) {
  ServerFixture f;
  EXPECT_TRUE(f.server.greeting().empty());
}

TEST(HandshakeTest, EncodersLayout) {
  Bytes w = encode_welcome(0x0102, 5, 6, 7, 8);
  ASSERT_EQ(w.size(), kWelcomeSize);
  EXPECT_EQ(w, (Bytes{'S', 'P', 'D', 'L', 0, 1, 1, 2, 0, 0, 0, 5, 0, 0, 0, 6, 0, 0, 0, 7, 0, 0,
                      0, 8}));
  Bytes r = encode_refusal("nope");
  EXPECT_EQ(r, (Bytes{'S', 'P', 'N', 'O', 0, 4, 'n', 'o', 'p', 'e'}));
  Bytes longr = encode_refusal(std::string(5000, 'x'));
  EXPECT_EQ(longr.size(), 6 + kMaxRefusalReason);
  EXPECT_EQ(be16(longr, 4), kMaxRefusalReason);
}

TEST(HandshakeTest, ServerHelloByteByByteThenWelcome) {
  ServerFixture f;
  RxBuffer rx;
  Bytes hello = encode_hello(kProtocolVersion, 0, 4242);
  Bytes reply;
  for (std::size_t i = 0; i < hello.size(); ++i) {
    push(rx, std::span<const std::uint8_t>(&hello[i], 1));
    HandshakeResult r = f.server.consume(rx, reply);
    if (i + 1 < hello.size()) {
      ASSERT_EQ(r.status, HandshakeStatus::kNeedMore) << "after " << i + 1 << " bytes: "
                                                      << r.error;
      EXPECT_EQ(r.consumed, 0u);
      EXPECT_TRUE(reply.empty());
      EXPECT_EQ(f.assign_calls, 0);
    } else {
      ASSERT_EQ(r.status, HandshakeStatus::kComplete) << r.error;
      EXPECT_EQ(r.consumed, kHelloSize);
    }
  }
  EXPECT_EQ(f.assign_calls, 1);
  ASSERT_TRUE(f.seen.has_value());
  EXPECT_EQ(f.seen->pid, 4242u);
  EXPECT_EQ(f.seen->version, kProtocolVersion);
  EXPECT_EQ(rx.readable(), 0u);

  ASSERT_EQ(reply.size(), kWelcomeSize);
  EXPECT_TRUE(starts_with(reply, "SPDL"));
  EXPECT_EQ(be16(reply, 4), kProtocolVersion);
  EXPECT_EQ(be16(reply, 6), 0u);
  EXPECT_EQ(be32(reply, 8), 42u);           // your_id
  EXPECT_EQ(be32(reply, 12), kServerId);    // server_id
  EXPECT_EQ(be32(reply, 16), kServerPid);   // server_pid
  EXPECT_EQ(be32(reply, 20), kMax);         // max_message_size
  EXPECT_EQ(reply, encode_welcome(0, 42, kServerId, kServerPid, kMax));

  const PeerInfo& peer = f.server.peer();
  EXPECT_EQ(peer.pid, 4242u);
  EXPECT_EQ(peer.remote_id, 42u);
  EXPECT_EQ(peer.local_id, kServerId);
  EXPECT_EQ(peer.version, kProtocolVersion);
}

TEST(HandshakeTest, ClientCompletesFromWelcome) {
  ServerHandshake server(7, kServerPid, kMax, [](const PeerInfo&) { return std::uint32_t{55}; });
  ClientHandshake client(999);
  RxBuffer srx, crx;
  Bytes sreply, creply;
  push(srx, client.greeting());
  HandshakeResult sr = server.consume(srx, sreply);
  ASSERT_EQ(sr.status, HandshakeStatus::kComplete) << sr.error;
  EXPECT_EQ(server.peer().pid, 999u);

  // Byte by byte into the client too.
  for (std::size_t i = 0; i < sreply.size(); ++i) {
    push(crx, std::span<const std::uint8_t>(&sreply[i], 1));
    HandshakeResult cr = client.consume(crx, creply);
    if (i + 1 < sreply.size()) {
      ASSERT_EQ(cr.status, HandshakeStatus::kNeedMore) << i << ": " << cr.error;
      EXPECT_EQ(cr.consumed, 0u);
    } else {
      ASSERT_EQ(cr.status, HandshakeStatus::kComplete) << cr.error;
      EXPECT_EQ(cr.consumed, kWelcomeSize);
    }
  }
  EXPECT_TRUE(creply.empty());
  const PeerInfo& p = client.peer();
  EXPECT_EQ(p.local_id, 55u);
  EXPECT_EQ(p.remote_id, 7u);
  EXPECT_EQ(p.pid, kServerPid);
  EXPECT_EQ(p.max_message_size, kMax);
  EXPECT_EQ(p.version, kProtocolVersion);
  EXPECT_EQ(crx.readable(), 0u);
}

TEST(HandshakeTest, BytesAfterHelloStayInRx) {
  ServerFixture f;
  RxBuffer rx;
  Bytes extra = {'M', 'I', 0, 0, 0, 1, 0xff, 0x00};
  push(rx, concat(encode_hello(kProtocolVersion, 0, 1), extra));
  Bytes reply;
  HandshakeResult r = f.server.consume(rx, reply);
  ASSERT_EQ(r.status, HandshakeStatus::kComplete) << r.error;
  EXPECT_EQ(r.consumed, kHelloSize);
  EXPECT_EQ(rx.readable(), extra.size());
  EXPECT_EQ(drain(rx), extra);
}

TEST(HandshakeTest, BytesAfterWelcomeStayInRx) {
  ClientHandshake client(1);
  RxBuffer rx;
  Bytes extra = {'S', 'R', 1, 2, 3};
  push(rx, concat(encode_welcome(0, 3, 0, 100, kMax), extra));
  Bytes reply;
  HandshakeResult r = client.consume(rx, reply);
  ASSERT_EQ(r.status, HandshakeStatus::kComplete) << r.error;
  EXPECT_EQ(r.consumed, kWelcomeSize);
  EXPECT_EQ(client.peer().local_id, 3u);
  EXPECT_EQ(drain(rx), extra);
}

TEST(HandshakeTest, WrongVersionRefusedAndClientReportsReason) {
  ServerFixture f;
  RxBuffer srx;
  push(srx, encode_hello(2, 0, 1234));
  Bytes sreply;
  HandshakeResult sr = f.server.consume(srx, sreply);
  ASSERT_EQ(sr.status, HandshakeStatus::kInvalid);
  EXPECT_FALSE(sr.error.empty());
  EXPECT_EQ(f.assign_calls, 0);
  ASSERT_GE(sreply.size(), 6u);
  EXPECT_TRUE(starts_with(sreply, "SPNO"));
  std::size_t len = be16(sreply, 4);
  ASSERT_EQ(sreply.size(), 6 + len);
  std::string reason(sreply.begin() + 6, sreply.end());
  EXPECT_EQ(reason, sr.error);
  EXPECT_NE(reason.find("version"), std::string::npos) << reason;

  ClientHandshake client(1234);
  RxBuffer crx;
  Bytes creply;
  // Refusal byte by byte: need-more until it is whole.
  for (std::size_t i = 0; i < sreply.size(); ++i) {
    push(crx, std::span<const std::uint8_t>(&sreply[i], 1));
    HandshakeResult cr = client.consume(crx, creply);
    if (i + 1 < sreply.size()) {
      ASSERT_EQ(cr.status, HandshakeStatus::kNeedMore) << i << ": " << cr.error;
    } else {
      ASSERT_EQ(cr.status, HandshakeStatus::kInvalid);
      EXPECT_NE(cr.error.find(reason), std::string::npos) << cr.error;
      EXPECT_EQ(cr.consumed, sreply.size());
    }
  }
  EXPECT_EQ(crx.readable(), 0u);
}

TEST(HandshakeTest, AssignRefusalCarriesReason) {
  ServerFixture f;
  f.answer = std::string("no room at the inn");
  RxBuffer srx;
  push(srx, encode_hello(kProtocolVersion, 0, 5));
  Bytes sreply;
  HandshakeResult sr = f.server.consume(srx, sreply);
  ASSERT_EQ(sr.status, HandshakeStatus::kInvalid);
  EXPECT_EQ(f.assign_calls, 1);
  EXPECT_NE(sr.error.find("no room at the inn"), std::string::npos) << sr.error;
  EXPECT_EQ(sreply, encode_refusal("no room at the inn"));

  ClientHandshake client(5);
  RxBuffer crx;
  push(crx, sreply);
  Bytes creply;
  HandshakeResult cr = client.consume(crx, creply);
  ASSERT_EQ(cr.status, HandshakeStatus::kInvalid);
  EXPECT_NE(cr.error.find("no room at the inn"), std::string::npos) << cr.error;
}

TEST(HandshakeTest, GarbageRejectedOnFirstByte) {
  ServerFixture f;
  RxBuffer rx;
  push(rx, std::string_view("G"));
  Bytes reply;
  HandshakeResult r = f.server.consume(rx, reply);
  EXPECT_EQ(r.status, HandshakeStatus::kInvalid);
  EXPECT_FALSE(r.error.empty());
  EXPECT_EQ(f.assign_calls, 0);
  EXPECT_TRUE(starts_with(reply, "SPNO")) << "a refusal explains itself";
}

TEST(HandshakeTest, HttpRequestRejectedBeforeHelloSize) {
  ServerFixture f;
  const std::string get = "GET / HTTP/1.1";
  // Every prefix that is shorter than a hello is already rejected.
  for (std::size_t n = 1; n <= 4; ++n) {
    ServerHandshake server(0, 1, kMax, [](const PeerInfo&) { return std::uint32_t{2}; });
    RxBuffer rx;
    push(rx, std::string_view(get).substr(0, n));
    Bytes reply;
    HandshakeResult r = server.consume(rx, reply);
    EXPECT_EQ(r.status, HandshakeStatus::kInvalid) << "prefix " << n;
  }
  RxBuffer rx;
  push(rx, get);
  Bytes reply;
  HandshakeResult r = f.server.consume(rx, reply);
  EXPECT_EQ(r.status, HandshakeStatus::kInvalid);
  EXPECT_EQ(f.assign_calls, 0);
}

TEST(HandshakeTest, PartialMagicPrefixNeedsMore) {
  // "S", "SP", "SPD" could still become a hello.
  for (std::size_t n = 1; n <= 3; ++n) {
    ServerFixture f;
    RxBuffer rx;
    push(rx, std::string_view("SPDL").substr(0, n));
    Bytes reply;
    HandshakeResult r = f.server.consume(rx, reply);
    EXPECT_EQ(r.status, HandshakeStatus::kNeedMore) << n;
    EXPECT_TRUE(reply.empty());
  }
  // "SPX" cannot.
  ServerFixture f;
  RxBuffer rx;
  push(rx, std::string_view("SPX"));
  Bytes reply;
  EXPECT_EQ(f.server.consume(rx, reply).status, HandshakeStatus::kInvalid);
}

TEST(HandshakeTest, EmptyInputNeedsMore) {
  ServerFixture f;
  RxBuffer rx;
  Bytes reply;
  HandshakeResult r = f.server.consume(rx, reply);
  EXPECT_EQ(r.status, HandshakeStatus::kNeedMore);
  ClientHandshake c(1);
  RxBuffer crx;
  EXPECT_EQ(c.consume(crx, reply).status, HandshakeStatus::kNeedMore);
}

TEST(HandshakeTest, MitogenFirstBytesRejected) {
  // A Mitogen peer opens with a frame header; its first 4 bytes are never "SPDL".
  ServerFixture f;
  RxBuffer rx;
  const Bytes mitogen = {0x00, 0x00, 0x12, 0x34};
  push(rx, mitogen);
  Bytes reply;
  HandshakeResult r = f.server.consume(rx, reply);
  EXPECT_EQ(r.status, HandshakeStatus::kInvalid);
  EXPECT_EQ(f.assign_calls, 0);

  // Even just its first byte.
  ServerFixture g;
  RxBuffer rx1;
  push(rx1, std::span<const std::uint8_t>(mitogen.data(), 1));
  EXPECT_EQ(g.server.consume(rx1, reply).status, HandshakeStatus::kInvalid);
}

// Both dialects leave the listener knowing how large a frame the client
// takes: a Spindle client's hello says so; a Mitogen client's 4-byte pid
// does not, and it gets Mitogen's default limit, however large the router's.
TEST(HandshakeTest, AListenerKnowsEachDialectsMaximum) {
  constexpr std::uint32_t kLarge = 1u << 30;
  auto assign = [](const PeerInfo&) -> ServerHandshake::Assignment { return std::uint32_t{9}; };
  ListenerHandshake mitogen(kServerId, kServerPid, kLarge, assign);
  RxBuffer rx;
  push(rx, Bytes{0x00, 0x00, 0x12, 0x34});
  Bytes reply;
  ASSERT_EQ(mitogen.consume(rx, reply).status, HandshakeStatus::kComplete);
  EXPECT_EQ(mitogen.peer().dialect, Dialect::kMitogen);
  EXPECT_EQ(mitogen.peer().max_message_size, kMitogenMaxMessageSize);

  ListenerHandshake spindle(kServerId, kServerPid, kLarge, assign);
  RxBuffer srx;
  push(srx, encode_hello(kProtocolVersion, kFlagMaxMessageSize, 4242, 4096));
  Bytes sreply;
  ASSERT_EQ(spindle.consume(srx, sreply).status, HandshakeStatus::kComplete);
  EXPECT_EQ(spindle.peer().dialect, Dialect::kSpindle);
  EXPECT_EQ(spindle.peer().max_message_size, 4096u);
}

TEST(HandshakeTest, ClientRejectsNonSpindleServer) {
  ClientHandshake client(1);
  RxBuffer rx;
  push(rx, std::string_view("HTTP/1.1 400 Bad Request\r\n"));
  Bytes reply;
  HandshakeResult r = client.consume(rx, reply);
  EXPECT_EQ(r.status, HandshakeStatus::kInvalid);
  EXPECT_NE(r.error.find("magic"), std::string::npos) << r.error;
}

TEST(HandshakeTest, ClientRejectsWelcomeWithWrongVersion) {
  ClientHandshake client(1);
  RxBuffer rx;
  Bytes w = encode_welcome(0, 3, 0, 100, kMax);
  w[5] = 9;  // version 9
  push(rx, w);
  Bytes reply;
  HandshakeResult r = client.consume(rx, reply);
  EXPECT_EQ(r.status, HandshakeStatus::kInvalid);
  EXPECT_NE(r.error.find("version"), std::string::npos) << r.error;
}

TEST(HandshakeTest, FullExchangeWithTrailingFrames) {
  // Both directions, with frame bytes right behind each handshake message.
  ServerFixture f;
  f.answer = std::uint32_t{1001};
  ClientHandshake client(31337);
  RxBuffer srx, crx;
  const Bytes c_after = {'S', 'R', 9, 9};
  const Bytes s_after = {'M', 'I', 7};
  push(srx, concat(client.greeting(), c_after));
  Bytes sreply;
  ASSERT_EQ(f.server.consume(srx, sreply).status, HandshakeStatus::kComplete);
  push(crx, concat(sreply, s_after));
  Bytes creply;
  ASSERT_EQ(client.consume(crx, creply).status, HandshakeStatus::kComplete);
  EXPECT_EQ(client.peer().local_id, 1001u);
  EXPECT_EQ(client.peer().remote_id, kServerId);
  EXPECT_EQ(f.server.peer().remote_id, 1001u);
  EXPECT_EQ(f.server.peer().pid, 31337u);
  EXPECT_EQ(drain(srx), c_after);
  EXPECT_EQ(drain(crx), s_after);
}

TEST(HandshakeTest, ServerAppendsToReply) {
  // handshake.h: consume() "May append bytes to send to `reply`" -- bytes the
  // caller already queued there must survive.
  ServerFixture f;
  RxBuffer rx;
  push(rx, encode_hello(kProtocolVersion, 0, 8));
  Bytes reply = {0xde, 0xad};
  HandshakeResult r = f.server.consume(rx, reply);
  ASSERT_EQ(r.status, HandshakeStatus::kComplete) << r.error;
  EXPECT_EQ(reply, concat(Bytes{0xde, 0xad}, encode_welcome(0, 42, kServerId, kServerPid, kMax)));
}

}  // namespace test_handshake
