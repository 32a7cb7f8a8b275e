// Tests for stream/frame.h (header codec), stream/payload.h and
// stream/message.h (reply shapes).
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "spindle/frame.h"
#include "spindle/message.h"
#include "stream/payload.h"

// Everything here lives in namespace test_frame, so that the unity build (scripts/test.sh)
// can put this file in one translation unit with other tests.
namespace test_frame {

using namespace spindle;


std::vector<std::uint8_t> bytes_of(const HeaderBytes& b) { return {b.begin(), b.end()}; }


// ---------------------------------------------------------------------------
// Frame header
// ---------------------------------------------------------------------------

TEST(FrameHeader, SizeIs26) {
  EXPECT_EQ(kHeaderSize, 26u);
  EXPECT_EQ(std::tuple_size_v<HeaderBytes>, 26u);
}

TEST(FrameHeader, EncodeMatchesHandWrittenBigEndianBytes) {
  Header h;
  h.enc = kEncMitogen;  // 0x4d49 -> 'M','I'
  h.dst_id = 0x01020304;
  h.src_id = 0x05060708;
  h.auth_id = 0x090a0b0c;
  h.handle = 0x0d0e0f10;
  h.reply_to = 0x11121314;
  h.length = 0xa1b2c3d4;
  const std::vector<std::uint8_t> expected = {
      'M',  'I',                    // enc
      0x01, 0x02, 0x03, 0x04,       // dst_id
      0x05, 0x06, 0x07, 0x08,       // src_id
      0x09, 0x0a, 0x0b, 0x0c,       // auth_id
      0x0d, 0x0e, 0x0f, 0x10,       // handle
      0x11, 0x12, 0x13, 0x14,       // reply_to
      0xa1, 0xb2, 0xc3, 0xd4,       // length
  };
  EXPECT_EQ(bytes_of(encode_header(h)), expected);
}

TEST(FrameHeader, EncFieldsSpellTheirNames) {
  const std::pair<std::uint16_t, const char*> cases[] = {
      {kEncMitogen, "MI"}, {kEncMitogenPickle, "MJ"}, {kEncMitogenRaw, "MK"},
      {kEncRaw, "SR"},     {kEncCallError, "SE"},
  };
  for (const auto& [enc, name] : cases) {
    Header h;
    h.enc = enc;
    HeaderBytes b = encode_header(h);
    EXPECT_EQ(b[0], static_cast<std::uint8_t>(name[0])) << name;
    EXPECT_EQ(b[1], static_cast<std::uint8_t>(name[1])) << name;
    EXPECT_EQ(enc_name(enc), name);
  }
  EXPECT_EQ(enc_name(0x0000), "unknown");
}

TEST(FrameHeader, DecodeHandWrittenBytes) {
  const std::uint8_t raw[kHeaderSize] = {
      'S',  'E',                    // enc
      0x00, 0x00, 0x00, 0x01,       // dst_id
      0xff, 0xff, 0xff, 0xfe,       // src_id
      0x80, 0x00, 0x00, 0x00,       // auth_id
      0x00, 0x00, 0x03, 0xe8,       // handle 1000
      0x00, 0x00, 0x03, 0xe7,       // reply_to 999
      0x00, 0x01, 0x00, 0x00,       // length 65536
  };
  Header h = decode_header(raw);
  EXPECT_EQ(h.enc, kEncCallError);
  EXPECT_EQ(h.dst_id, 1u);
  EXPECT_EQ(h.src_id, 0xfffffffeu);
  EXPECT_EQ(h.auth_id, 0x80000000u);
  EXPECT_EQ(h.handle, 1000u);
  EXPECT_EQ(h.reply_to, 999u);
  EXPECT_EQ(h.length, 65536u);
  EXPECT_TRUE(h.is_dead());
}

TEST(FrameHeader, RoundTripAllFields) {
  const std::uint32_t values[] = {0u, 1u, 0x7fu, 0x80u, 0xffu, 0x100u, 0x12345678u,
                                  0x80000000u, 0xfffffffeu, 0xffffffffu};
  const std::uint16_t encs[] = {kEncMitogen, kEncMitogenPickle, kEncMitogenRaw, kEncRaw,
                                kEncCallError, 0x0000, 0xffff, 0x1234};
  int n = 0;
  for (std::uint16_t enc : encs) {
    for (std::size_t i = 0; i < std::size(values); ++i) {
      Header h;
      h.enc = enc;
      // Different value in each field so swapped fields would be noticed.
      h.dst_id = values[i];
      h.src_id = values[(i + 1) % std::size(values)];
      h.auth_id = values[(i + 2) % std::size(values)];
      h.handle = values[(i + 3) % std::size(values)];
      h.reply_to = values[(i + 4) % std::size(values)];
      h.length = values[(i + 5) % std::size(values)];
      HeaderBytes b = encode_header(h);
      Header back = decode_header(b.data());
      EXPECT_EQ(back, h) << "enc=" << enc << " i=" << i;
      EXPECT_EQ(back.enc, h.enc);
      EXPECT_EQ(back.dst_id, h.dst_id);
      EXPECT_EQ(back.src_id, h.src_id);
      EXPECT_EQ(back.auth_id, h.auth_id);
      EXPECT_EQ(back.handle, h.handle);
      EXPECT_EQ(back.reply_to, h.reply_to);
      EXPECT_EQ(back.length, h.length);
      ++n;
    }
  }
  EXPECT_EQ(n, 80);
}

TEST(FrameHeader, DecodeReadsFromUnalignedPointer) {
  Header h{kEncRaw, 11, 22, 33, 44, 55, 66};
  HeaderBytes b = encode_header(h);
  std::vector<std::uint8_t> buf(kHeaderSize + 3, 0xee);
  std::memcpy(buf.data() + 3, b.data(), kHeaderSize);
  EXPECT_EQ(decode_header(buf.data() + 3), h);
}

TEST(FrameHeader, IsKnownEncAcceptsTheSixEncodings) {
  EXPECT_TRUE(is_known_enc(0x4d49));  // MI
  EXPECT_TRUE(is_known_enc(0x4d4a));  // MJ
  EXPECT_TRUE(is_known_enc(0x4d4b));  // MK
  EXPECT_TRUE(is_known_enc(0x5352));  // SR
  EXPECT_TRUE(is_known_enc(0x5345));  // SE
  EXPECT_TRUE(is_known_enc(0x5346));  // SF: carries fds (PROTOCOL.md §13)
}

TEST(FrameHeader, IsKnownEncRejectsOthers) {
  const std::uint16_t bad[] = {0x0000, 0xffff, 0x4d48, 0x4d4c, 0x494d /* "IM" */,
                               0x5351, 0x5353, 0x5344, 0x5347, 0x5250 /* "RP" */,
                               0x4745 /* "GE" */, 0x5350 /* "SP" */, 0x0012};
  for (std::uint16_t e : bad) EXPECT_FALSE(is_known_enc(e)) << std::hex << e;
  // Exhaustive: exactly six of the 65536 values are accepted.
  int known = 0;
  for (std::uint32_t e = 0; e <= 0xffff; ++e) known += is_known_enc(static_cast<std::uint16_t>(e));
  EXPECT_EQ(known, 6);
}

TEST(FrameHeader, OnlyMIIsMitogenDecodable) {
  EXPECT_TRUE(mitogen_can_decode(kEncMitogen));
  EXPECT_FALSE(mitogen_can_decode(kEncMitogenPickle));
  EXPECT_FALSE(mitogen_can_decode(kEncMitogenRaw));
  EXPECT_FALSE(mitogen_can_decode(kEncRaw));
  EXPECT_FALSE(mitogen_can_decode(kEncCallError));
}

TEST(FrameHeader, IsDeadOnlyForReplyTo999) {
  Header h;
  EXPECT_FALSE(h.is_dead());
  h.reply_to = kHandleIsDead;
  EXPECT_TRUE(h.is_dead());
  h.reply_to = 1000;
  EXPECT_FALSE(h.is_dead());
}

// ---------------------------------------------------------------------------
// Payload
// ---------------------------------------------------------------------------

TEST(PayloadSlices, DefaultIsEmpty) {
  Payload p;
  EXPECT_TRUE(p.empty());
  EXPECT_EQ(p.size(), 0u);
  EXPECT_TRUE(p.slices().empty());
  EXPECT_EQ(p.to_string(), "");
  EXPECT_TRUE(p.contiguous().empty());
}

TEST(PayloadSlices, CopyOfStringIsOneSliceAndIndependent) {
  std::string src("hello\0world", 11);
  Payload p = Payload::copy_of(std::string_view(src));
  src[0] = 'J';  // the payload holds a copy
  EXPECT_EQ(p.size(), 11u);
  EXPECT_FALSE(p.empty());
  ASSERT_EQ(p.slices().size(), 1u);
  EXPECT_EQ(p.to_string(), std::string("hello\0world", 11));
  auto c = p.contiguous();
  ASSERT_EQ(c.size(), 11u);
  EXPECT_EQ(std::memcmp(c.data(), "hello\0world", 11), 0);
  EXPECT_NE(static_cast<const void*>(c.data()), static_cast<const void*>(src.data()));
}

TEST(PayloadSlices, CopyOfSpanAndCopyTo) {
  std::vector<std::uint8_t> src = {0, 1, 2, 0xfe, 0xff};
  Payload p = Payload::copy_of(std::span<const std::uint8_t>(src));
  EXPECT_EQ(p.size(), 5u);
  std::vector<std::uint8_t> out(7, 0xaa);
  p.copy_to(out.data() + 1);
  EXPECT_EQ(out, (std::vector<std::uint8_t>{0xaa, 0, 1, 2, 0xfe, 0xff, 0xaa}));
}

TEST(PayloadSlices, CopyOfEmptyIsEmpty) {
  Payload p = Payload::copy_of(std::string_view());
  EXPECT_TRUE(p.empty());
  EXPECT_TRUE(p.slices().empty());
  EXPECT_EQ(p.to_string(), "");
}

TEST(PayloadSlices, MultiSliceJoinsOnlyOnRequest) {
  auto a = std::make_shared<Chunk>(8);
  auto b = std::make_shared<Chunk>(8);
  std::memcpy(a->data(), "abcdefgh", 8);
  std::memcpy(b->data(), "12345678", 8);
  Payload p;
  p.append(Slice{a, a->data() + 2, 3});  // "cde"
  p.append(Slice{b, b->data(), 0});      // empty slices are ignored
  p.append(Slice{b, b->data() + 4, 4});  // "5678"
  EXPECT_EQ(p.size(), 7u);
  ASSERT_EQ(p.slices().size(), 2u);
  EXPECT_TRUE(p.contiguous().empty()) << "two slices are not contiguous";
  EXPECT_EQ(p.to_string(), "cde5678");
  std::string out(7, '?');
  p.copy_to(reinterpret_cast<std::uint8_t*>(out.data()));
  EXPECT_EQ(out, "cde5678");
  // Slices share the chunks rather than copying them.
  EXPECT_EQ(p.slices()[0].data, a->data() + 2);
  EXPECT_EQ(p.slices()[1].data, b->data() + 4);
  EXPECT_EQ(a.use_count(), 2);
}

TEST(PayloadSlices, AdoptIsOneSliceOverThePrefix) {
  auto c = std::make_shared<Chunk>(16);
  std::memcpy(c->data(), "0123456789abcdef", 16);
  const std::uint8_t* raw = c->data();
  Payload p = Payload::adopt(c, 10);
  ASSERT_EQ(p.slices().size(), 1u);
  auto span = p.contiguous();
  EXPECT_EQ(span.data(), raw);
  EXPECT_EQ(span.size(), 10u);
  EXPECT_EQ(p.to_string(), "0123456789");
}

TEST(PayloadSlices, PayloadKeepsChunkAlive) {
  Payload p;
  {
    auto c = std::make_shared<Chunk>(4);
    std::memcpy(c->data(), "live", 4);
    p = Payload::adopt(c, 4);
  }
  EXPECT_EQ(p.to_string(), "live");
}

// ---------------------------------------------------------------------------
// Message
// ---------------------------------------------------------------------------


Message request_from(std::uint32_t src, std::uint32_t reply_to, std::uint32_t handle = 4321) {
  Message m;
  m.header.enc = kEncRaw;
  m.header.dst_id = 7;
  m.header.src_id = src;
  m.header.auth_id = src;
  m.header.handle = handle;
  m.header.reply_to = reply_to;
  m.data = Payload::copy_of(std::string_view("request body"));
  m.header.length = static_cast<std::uint32_t>(m.data.size());
  return m;
}


TEST(MessageShapes, MakeSetsFields) {
  Message m = Message::make(12, 1005, Payload::copy_of(std::string_view("x")), kEncCallError);
  EXPECT_EQ(m.header.dst_id, 12u);
  EXPECT_EQ(m.header.handle, 1005u);
  EXPECT_EQ(m.header.enc, kEncCallError);
  EXPECT_EQ(m.header.reply_to, 0u);
  EXPECT_EQ(m.text(), "x");
  Message d = Message::make(1, 2, Payload());
  EXPECT_EQ(d.header.enc, kEncRaw);
}

TEST(MessageShapes, ReplyToAddressesTheSender) {
  Message req = request_from(42, 1234);
  Message rep = Message::reply_to(req, Payload::copy_of(std::string_view("answer")));
  EXPECT_EQ(rep.header.dst_id, 42u);
  EXPECT_EQ(rep.header.handle, 1234u);
  EXPECT_EQ(rep.header.enc, kEncRaw);
  EXPECT_EQ(rep.text(), "answer");
  EXPECT_FALSE(rep.is_dead());
}

TEST(MessageShapes, DeadReplySwapsIds) {
  Message req = request_from(42, 1234, 5555);
  Message dead = Message::dead_reply(req, "no such handle");
  EXPECT_EQ(dead.header.dst_id, 42u);      // request's src
  EXPECT_EQ(dead.header.handle, 1234u);    // request's reply_to
  EXPECT_EQ(dead.header.reply_to, 999u);   // IS_DEAD
  EXPECT_EQ(dead.header.enc, kEncMitogen);  // "MI": readable by Mitogen
  EXPECT_EQ(dead.text(), "no such handle");
  EXPECT_TRUE(dead.is_dead());
  EXPECT_TRUE(dead.header.is_dead());
  EXPECT_FALSE(dead.is_call_error());
  EXPECT_FALSE(Message::wants_dead_reply(dead));
}

TEST(MessageShapes, DeadReplyWithEmptyReason) {
  Message dead = Message::dead_reply(request_from(3, 1001), "");
  EXPECT_TRUE(dead.data.empty());
  EXPECT_TRUE(dead.is_dead());
  EXPECT_EQ(dead.header.dst_id, 3u);
}

TEST(MessageShapes, CallErrorRoundTrip) {
  Message req = request_from(9, 2000);
  Message err = Message::call_error(req, "ValueError", "bad value: 42");
  EXPECT_EQ(err.header.enc, kEncCallError);
  EXPECT_TRUE(err.is_call_error());
  EXPECT_FALSE(err.is_dead());
  EXPECT_EQ(err.header.dst_id, 9u);
  EXPECT_EQ(err.header.handle, 2000u);
  EXPECT_EQ(err.text(), std::string("ValueError\0bad value: 42", 24));
  CallErrorText t = parse_call_error(err);
  EXPECT_EQ(t.type, "ValueError");
  EXPECT_EQ(t.what, "bad value: 42");
}

TEST(MessageShapes, CallErrorMessageMayContainNul) {
  Message err =
      Message::call_error(request_from(1, 1001), "T", std::string_view("a\0b", 3));
  CallErrorText t = parse_call_error(err);
  EXPECT_EQ(t.type, "T");
  EXPECT_EQ(t.what, std::string("a\0b", 3));
}

TEST(MessageShapes, CallErrorEmptyParts) {
  CallErrorText t = parse_call_error(Message::call_error(request_from(1, 1001), "", ""));
  EXPECT_EQ(t.type, "");
  EXPECT_EQ(t.what, "");
}

TEST(MessageShapes, ParseCallErrorWithoutNul) {
  Message m = Message::make(1, 2, Payload::copy_of(std::string_view("just text")), kEncCallError);
  CallErrorText t = parse_call_error(m);
  EXPECT_EQ(t.type, "CallError");
  EXPECT_EQ(t.what, "just text");
}

TEST(MessageShapes, WantsDeadReply) {
  EXPECT_TRUE(Message::wants_dead_reply(request_from(5, 1234)));
  EXPECT_FALSE(Message::wants_dead_reply(request_from(5, 0)));
  EXPECT_FALSE(Message::wants_dead_reply(request_from(5, kHandleIsDead)));
}

}  // namespace test_frame
