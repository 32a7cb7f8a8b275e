// Tests for stream/parser.h (FrameParser over an RxBuffer) and, through it,
// stream/rx_buffer.h.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <span>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "spindle/frame.h"
#include "spindle/message.h"
#include "stream/parser.h"
#include "stream/rx_buffer.h"

// Everything here lives in namespace test_parser, so that the unity build (scripts/test.sh)
// can put this file in one translation unit with other tests.
namespace test_parser {

using namespace spindle;


using Bytes = std::vector<std::uint8_t>;

// Deterministic, position-dependent content so misplaced bytes are noticed.
Bytes pattern(std::size_t n, std::uint32_t seed) {
  Bytes b(n);
  std::uint32_t x = seed * 2654435761u + 1;
  for (std::size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    b[i] = static_cast<std::uint8_t>(x >> 24);
  }
  return b;
}

Header header_for(std::uint32_t i, std::size_t len, std::uint16_t enc = kEncRaw) {
  Header h;
  h.enc = enc;
  h.dst_id = 100 + i;
  h.src_id = 200 + i;
  h.auth_id = 300 + i;
  h.handle = 1000 + i;
  h.reply_to = i % 3 == 0 ? 0 : 2000 + i;
  h.length = static_cast<std::uint32_t>(len);
  return h;
}

Bytes frame(const Header& h, const Bytes& body) {
  Header hh = h;
  hh.length = static_cast<std::uint32_t>(body.size());
  HeaderBytes hb = encode_header(hh);
  Bytes out(hb.begin(), hb.end());
  out.insert(out.end(), body.begin(), body.end());
  return out;
}

Bytes payload_bytes(const Payload& p) {
  Bytes out(p.size());
  p.copy_to(out.data());
  return out;
}

struct Parsed {
  Header header;
  Bytes body;
  std::size_t slices = 0;
  bool operator==(const Parsed& o) const { return header == o.header && body == o.body; }
};

// Drains every complete message; fails the test on kInvalid.
struct Drain {
  std::vector<Parsed> msgs;
  std::size_t consumed = 0;

  void run(FrameParser& p) {
    for (;;) {
      Message m;
      ParseResult r = p.next(m);
      consumed += r.consumed;
      if (r.status == ParseStatus::kNeedMore) return;
      ASSERT_NE(r.status, ParseStatus::kInvalid) << r.error;
      msgs.push_back({m.header, payload_bytes(m.data), m.data.slices().size()});
    }
  }
};

void feed(FrameParser& p, const Bytes& b, std::size_t off, std::size_t n) {
  p.feed(std::span<const std::uint8_t>(b.data() + off, n));
}

// A stream of small frames (all below kDirectBodyThreshold), various encs.
struct Corpus {
  Bytes stream;
  std::vector<Parsed> expected;
};

Corpus small_corpus() {
  const std::size_t sizes[] = {0, 1, 25, 26, 27, 100, 0, 4096, 70000, 3, 131072, 200000, 0, 9};
  const std::uint16_t encs[] = {kEncRaw, kEncMitogen, kEncCallError, kEncMitogenPickle,
                                kEncMitogenRaw};
  Corpus c;
  std::uint32_t i = 0;
  for (std::size_t n : sizes) {
    Header h = header_for(i, n, encs[i % std::size(encs)]);
    Bytes body = pattern(n, i);
    Bytes f = frame(h, body);
    c.stream.insert(c.stream.end(), f.begin(), f.end());
    c.expected.push_back({h, body, 0});
    ++i;
  }
  return c;
}


// ---------------------------------------------------------------------------
// Basic framing
// ---------------------------------------------------------------------------

TEST(FrameParserTest, OneFrameFedWhole) {
  RxBuffer rx;
  FrameParser p(rx);
  Header h = header_for(1, 5, kEncMitogen);
  Bytes f = frame(h, Bytes{'h', 'e', 'l', 'l', 'o'});
  p.feed(f);
  EXPECT_EQ(p.buffered(), f.size());
  Message m;
  ParseResult r = p.next(m);
  ASSERT_EQ(r.status, ParseStatus::kComplete) << r.error;
  EXPECT_EQ(r.consumed, f.size());
  EXPECT_EQ(m.header, h);
  EXPECT_EQ(m.text(), "hello");
  EXPECT_EQ(rx.readable(), 0u);
  EXPECT_EQ(p.buffered(), 0u);
  Message m2;
  ParseResult r2 = p.next(m2);
  EXPECT_EQ(r2.status, ParseStatus::kNeedMore);
  EXPECT_EQ(r2.consumed, 0u);
}

TEST(FrameParserTest, ManyFramesInOneBuffer) {
  Corpus c = small_corpus();
  RxBuffer rx;
  FrameParser p(rx);
  p.feed(c.stream);
  Drain d;
  d.run(p);
  EXPECT_EQ(d.msgs, c.expected);
  EXPECT_EQ(d.consumed, c.stream.size());
  EXPECT_EQ(rx.readable(), 0u);
}

TEST(FrameParserTest, ByteByByteMatchesWhole) {
  Corpus c = small_corpus();
  RxBuffer rx;
  FrameParser p(rx);
  Drain d;
  for (std::size_t i = 0; i < c.stream.size(); ++i) {
    feed(p, c.stream, i, 1);
    d.run(p);
    if (HasFatalFailure()) return;
    ASSERT_EQ(d.consumed + p.buffered(), i + 1) << "at byte " << i;
  }
  EXPECT_EQ(d.msgs, c.expected);
  EXPECT_EQ(d.consumed, c.stream.size());
  EXPECT_EQ(p.buffered(), 0u);
}

TEST(FrameParserTest, RandomPiecesMatchWhole) {
  Corpus c = small_corpus();
  for (std::uint32_t seed : {1u, 7u, 12345u}) {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<std::size_t> piece(1, 9000);
    RxBuffer rx;
    FrameParser p(rx);
    Drain d;
    std::size_t off = 0;
    while (off < c.stream.size()) {
      std::size_t n = std::min(piece(rng), c.stream.size() - off);
      feed(p, c.stream, off, n);
      off += n;
      d.run(p);
      if (HasFatalFailure()) return;
      ASSERT_EQ(d.consumed + p.buffered(), off);
    }
    EXPECT_EQ(d.msgs, c.expected) << "seed " << seed;
    EXPECT_EQ(d.consumed, c.stream.size()) << "seed " << seed;
  }
}

TEST(FrameParserTest, ZeroLengthPayloads) {
  RxBuffer rx;
  FrameParser p(rx);
  Bytes s;
  for (std::uint32_t i = 0; i < 3; ++i) {
    Bytes f = frame(header_for(i, 0), {});
    ASSERT_EQ(f.size(), kHeaderSize);
    s.insert(s.end(), f.begin(), f.end());
  }
  // Feed just one header: a complete, empty message.
  feed(p, s, 0, kHeaderSize);
  Message m;
  ParseResult r = p.next(m);
  ASSERT_EQ(r.status, ParseStatus::kComplete) << r.error;
  EXPECT_EQ(r.consumed, kHeaderSize);
  EXPECT_TRUE(m.data.empty());
  EXPECT_EQ(m.data.size(), 0u);
  EXPECT_EQ(m.header, header_for(0, 0));
  // The other two together.
  feed(p, s, kHeaderSize, 2 * kHeaderSize);
  Drain d;
  d.run(p);
  ASSERT_EQ(d.msgs.size(), 2u);
  EXPECT_EQ(d.msgs[0].header, header_for(1, 0));
  EXPECT_EQ(d.msgs[1].header, header_for(2, 0));
  EXPECT_TRUE(d.msgs[0].body.empty());
  EXPECT_EQ(d.consumed, 2 * kHeaderSize);
}

TEST(FrameParserTest, PartialHeaderNeedsMore) {
  RxBuffer rx;
  FrameParser p(rx);
  Bytes f = frame(header_for(1, 4), Bytes{1, 2, 3, 4});
  for (std::size_t n = 0; n < kHeaderSize; ++n) {
    if (n > 0) feed(p, f, n - 1, 1);
    Message m;
    ParseResult r = p.next(m);
    EXPECT_EQ(r.status, ParseStatus::kNeedMore) << n;
    EXPECT_EQ(r.consumed, 0u) << n;
    EXPECT_EQ(rx.readable(), n);
  }
  // Header complete, body not: still need more, nothing consumed (small body).
  feed(p, f, kHeaderSize - 1, 3);
  Message m;
  ParseResult r = p.next(m);
  EXPECT_EQ(r.status, ParseStatus::kNeedMore);
  EXPECT_EQ(r.consumed, 0u);
  feed(p, f, kHeaderSize + 2, 2);
  r = p.next(m);
  ASSERT_EQ(r.status, ParseStatus::kComplete);
  EXPECT_EQ(r.consumed, f.size());
  EXPECT_EQ(payload_bytes(m.data), (Bytes{1, 2, 3, 4}));
}

// ---------------------------------------------------------------------------
// Chunk boundaries
// ---------------------------------------------------------------------------

TEST(FrameParserTest, HeaderStraddlesChunkBoundary) {
  ASSERT_EQ(kChunkSize, 128u * 1024);
  // First frame leaves exactly 10 bytes free in the first chunk.
  const std::size_t pad_len = kChunkSize - 10 - kHeaderSize;
  Header h1 = header_for(1, pad_len);
  Bytes b1 = pattern(pad_len, 1);
  Header h2 = header_for(2, 1000, kEncMitogen);
  Bytes b2 = pattern(1000, 2);
  Bytes s = frame(h1, b1);
  ASSERT_EQ(s.size(), kChunkSize - 10);
  Bytes f2 = frame(h2, b2);
  s.insert(s.end(), f2.begin(), f2.end());

  RxBuffer rx;
  FrameParser p(rx);
  p.feed(s);
  EXPECT_EQ(rx.chunk_count(), 2u);  // the second header really straddles
  Message m1, m2;
  ParseResult r1 = p.next(m1);
  ASSERT_EQ(r1.status, ParseStatus::kComplete) << r1.error;
  EXPECT_EQ(r1.consumed, kChunkSize - 10);
  EXPECT_EQ(m1.header, h1);
  EXPECT_EQ(payload_bytes(m1.data), b1);
  EXPECT_EQ(m1.data.slices().size(), 1u);
  ParseResult r2 = p.next(m2);
  ASSERT_EQ(r2.status, ParseStatus::kComplete) << r2.error;
  EXPECT_EQ(r2.consumed, f2.size());
  EXPECT_EQ(m2.header, h2);
  EXPECT_EQ(payload_bytes(m2.data), b2);
  // Body is entirely in the second chunk.
  EXPECT_EQ(m2.data.slices().size(), 1u);
}

TEST(FrameParserTest, HeaderStraddlesChunkBoundaryFedInTwoParts) {
  // Same layout, but the straddling header arrives in two feeds split at the
  // boundary, with next() called in between (the first message kept alive so
  // its chunk is not rewound).
  const std::size_t pad_len = kChunkSize - 10 - kHeaderSize;
  Header h1 = header_for(1, pad_len);
  Bytes b1 = pattern(pad_len, 11);
  Header h2 = header_for(2, 77);
  Bytes b2 = pattern(77, 12);
  Bytes s = frame(h1, b1);
  Bytes f2 = frame(h2, b2);
  s.insert(s.end(), f2.begin(), f2.end());

  RxBuffer rx;
  FrameParser p(rx);
  feed(p, s, 0, kChunkSize);  // first frame + 10 header bytes
  Drain d;
  d.run(p);
  ASSERT_EQ(d.msgs.size(), 1u);
  EXPECT_EQ(rx.readable(), 10u);
  feed(p, s, kChunkSize, s.size() - kChunkSize);
  d.run(p);
  ASSERT_EQ(d.msgs.size(), 2u);
  EXPECT_EQ(d.msgs[0].header, h1);
  EXPECT_EQ(d.msgs[0].body, b1);
  EXPECT_EQ(d.msgs[1].header, h2);
  EXPECT_EQ(d.msgs[1].body, b2);
  EXPECT_EQ(d.consumed, s.size());
}

TEST(FrameParserTest, BodySpansSeveralChunksAsSlices) {
  // Pad so the next header straddles, then a body of two chunks. Fed whole
  // it is complete when parsed, spans three 128 KiB chunks and must come
  // back as slices of them (never joined); fed in pieces it is a large body
  // not yet complete, read into one buffer of its own (one slice).
  const std::size_t pad_len = kChunkSize - 10 - kHeaderSize;
  const std::size_t big = 2 * kChunkSize;
  Header h1 = header_for(1, pad_len);
  Bytes b1 = pattern(pad_len, 21);
  Header h2 = header_for(2, big, kEncMitogenRaw);
  Bytes b2 = pattern(big, 22);
  Header h3 = header_for(3, 5);
  Bytes b3 = pattern(5, 23);
  Bytes s = frame(h1, b1);
  for (const Bytes& f : {frame(h2, b2), frame(h3, b3)}) s.insert(s.end(), f.begin(), f.end());

  for (std::size_t piece : {s.size(), std::size_t{4096}, std::size_t{1}}) {
    RxBuffer rx;
    FrameParser p(rx);
    Drain d;
    std::vector<Message> kept;
    for (std::size_t off = 0; off < s.size(); off += piece) {
      feed(p, s, off, std::min(piece, s.size() - off));
      for (;;) {
        Message m;
        ParseResult r = p.next(m);
        d.consumed += r.consumed;
        ASSERT_NE(r.status, ParseStatus::kInvalid) << r.error;
        if (r.status != ParseStatus::kComplete) break;
        kept.push_back(std::move(m));
      }
    }
    ASSERT_EQ(kept.size(), 3u) << "piece " << piece;
    EXPECT_EQ(kept[1].header, h2);
    ASSERT_EQ(kept[1].data.size(), big);
    EXPECT_EQ(payload_bytes(kept[1].data), b2) << "piece " << piece;
    if (piece == s.size()) {
      EXPECT_EQ(kept[1].data.slices().size(), 3u) << "body was joined (piece " << piece << ")";
      EXPECT_TRUE(kept[1].data.contiguous().empty());
    } else {
      EXPECT_EQ(kept[1].data.slices().size(), 1u) << "piece " << piece;
    }
    // Each slice's bytes are exactly the corresponding part of the body.
    std::size_t pos = 0;
    for (const Slice& sl : kept[1].data.slices()) {
      ASSERT_LE(pos + sl.size, b2.size());
      EXPECT_EQ(std::memcmp(sl.data, b2.data() + pos, sl.size), 0);
      pos += sl.size;
    }
    EXPECT_EQ(pos, big);
    EXPECT_EQ(kept[2].header, h3);
    EXPECT_EQ(payload_bytes(kept[2].data), b3);
    EXPECT_EQ(payload_bytes(kept[0].data), b1);
    EXPECT_EQ(d.consumed, s.size());
  }
}

TEST(FrameParserTest, PayloadSurvivesLaterInput) {
  // Payload slices share rx chunks; later input must not overwrite them.
  RxBuffer rx;
  FrameParser p(rx);
  Bytes b1 = pattern(500, 31);
  Bytes f1 = frame(header_for(1, 500), b1);
  p.feed(f1);
  Message m1;
  ASSERT_EQ(p.next(m1).status, ParseStatus::kComplete);
  Bytes more;
  for (std::uint32_t i = 2; i < 400; ++i) {
    Bytes f = frame(header_for(i, 997), pattern(997, i));
    more.insert(more.end(), f.begin(), f.end());
  }
  p.feed(more);
  Drain d;
  d.run(p);
  EXPECT_EQ(d.msgs.size(), 398u);
  EXPECT_EQ(payload_bytes(m1.data), b1);
}

// A peer streaming small messages that are handled and let go: the reads
// land in two chunks that take turns, whatever the reads' sizes, and no
// frame holds two chunks. (Before, the frame across each chunk boundary held
// the full chunk as it retired, and every chunk after the first was new.)
// The chunks are told apart by their control blocks, which the weak
// references keep from being reused. Bytes come in as a stream reads them:
// into read_target(), at most `read` at a time, each read's frames handled
// before the next.
TEST(FrameParserTest, SmallFramesHandledAndLetGoReuseTwoChunks) {
  Bytes s;
  constexpr std::uint32_t kFrames = 20000;  // about 14 chunks of 90-byte frames
  for (std::uint32_t i = 0; i < kFrames; ++i) {
    Bytes f = frame(header_for(i, 64), pattern(64, i));
    s.insert(s.end(), f.begin(), f.end());
  }
  for (std::size_t read : {std::size_t{65536}, std::size_t{4099}, kChunkSize}) {
    RxBuffer rx;
    FrameParser p(rx);
    std::set<std::weak_ptr<const void>, std::owner_less<>> chunks;
    std::uint32_t seen = 0;
    for (std::size_t off = 0; off < s.size();) {
      auto dst = p.read_target();
      const std::size_t n = std::min({dst.size(), read, s.size() - off});
      std::memcpy(dst.data(), s.data() + off, n);
      p.commit(n);
      off += n;
      for (;;) {
        Message m;
        ParseResult r = p.next(m);
        ASSERT_NE(r.status, ParseStatus::kInvalid) << r.error;
        if (r.status != ParseStatus::kComplete) break;
        ASSERT_EQ(m.header.handle, 1000 + seen) << "read " << read;
        ASSERT_EQ(payload_bytes(m.data), pattern(64, seen)) << "read " << read;
        EXPECT_EQ(m.data.slices().size(), 1u) << "frame " << seen << " holds two chunks (read " << read << ")";
        chunks.insert(m.data.slices().front().owner);
        ++seen;
      }
    }
    EXPECT_EQ(seen, kFrames);
    EXPECT_EQ(chunks.size(), 2u) << "read " << read;
  }
}

// ---------------------------------------------------------------------------
// Validation from the header alone
// ---------------------------------------------------------------------------

TEST(FrameParserTest, BadMagicFromHeaderAlone) {
  RxBuffer rx;
  FrameParser p(rx);
  Header h = header_for(1, 1000, 0x4745 /* "GE" */);
  HeaderBytes hb = encode_header(h);
  p.feed(hb);  // header only, no body
  Message m;
  ParseResult r = p.next(m);
  EXPECT_EQ(r.status, ParseStatus::kInvalid);
  EXPECT_NE(r.error.find("magic"), std::string::npos) << r.error;
  EXPECT_EQ(r.header.enc, 0x4745);
  EXPECT_FALSE(r.header_valid);
}

TEST(FrameParserTest, HttpRequestIsBadMagic) {
  RxBuffer rx;
  FrameParser p(rx);
  std::string get = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
  p.feed(std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(get.data()),
                                       get.size()));
  Message m;
  ParseResult r = p.next(m);
  EXPECT_EQ(r.status, ParseStatus::kInvalid);
  EXPECT_NE(r.error.find("magic"), std::string::npos) << r.error;
}

TEST(FrameParserTest, BadMagicAfterGoodFrame) {
  RxBuffer rx;
  FrameParser p(rx);
  Bytes s = frame(header_for(1, 3), Bytes{7, 8, 9});
  Bytes bad = frame(header_for(2, 3, 0x0000), Bytes{1, 2, 3});
  s.insert(s.end(), bad.begin(), bad.end());
  p.feed(s);
  Message m;
  ParseResult r = p.next(m);
  ASSERT_EQ(r.status, ParseStatus::kComplete);
  Message m2;
  r = p.next(m2);
  EXPECT_EQ(r.status, ParseStatus::kInvalid);
  EXPECT_NE(r.error.find("magic"), std::string::npos) << r.error;
}

TEST(FrameParserTest, TooLargeBeforeAnyBodyByte) {
  RxBuffer rx;
  FrameParser p(rx, 1000);
  EXPECT_EQ(p.max_message_size(), 1000u);
  Header h = header_for(1, 1001);
  p.feed(encode_header(h));
  Message m;
  ParseResult r = p.next(m);
  EXPECT_EQ(r.status, ParseStatus::kInvalid);
  EXPECT_NE(r.error.find("too large"), std::string::npos) << r.error;
  EXPECT_TRUE(r.header_valid);
  EXPECT_EQ(r.header, h);
}

TEST(FrameParserTest, TooLargeHugeLengthWithDefaultMax) {
  RxBuffer rx;
  FrameParser p(rx);
  Header h = header_for(1, 0);
  h.length = 0xffffffffu;  // would be a 4 GiB allocation if not checked first
  p.feed(encode_header(h));
  Message m;
  ParseResult r = p.next(m);
  EXPECT_EQ(r.status, ParseStatus::kInvalid);
  EXPECT_NE(r.error.find("too large"), std::string::npos) << r.error;
  EXPECT_EQ(p.buffered(), kHeaderSize);  // nothing allocated for a body
}

TEST(FrameParserTest, LengthEqualToMaxIsAccepted) {
  RxBuffer rx;
  FrameParser p(rx, 1000);
  Header h = header_for(1, 1000);
  Bytes body = pattern(1000, 5);
  p.feed(frame(h, body));
  Message m;
  ParseResult r = p.next(m);
  ASSERT_EQ(r.status, ParseStatus::kComplete) << r.error;
  EXPECT_EQ(payload_bytes(m.data), body);
}

TEST(FrameParserTest, LengthEqualToMaxHeaderOnlyNeedsMore) {
  RxBuffer rx;
  FrameParser p(rx, 1000);
  p.feed(encode_header(header_for(1, 1000)));
  Message m;
  ParseResult r = p.next(m);
  EXPECT_EQ(r.status, ParseStatus::kNeedMore) << r.error;
}

// ---------------------------------------------------------------------------
// Large bodies read directly into one buffer
// ---------------------------------------------------------------------------


constexpr std::size_t kBig = 3u << 20;  // 3 MiB


TEST(FrameParserTest, LargeBodyFedIn4KiBPiecesIsOneSlice) {
  static_assert(kBig >= kDirectBodyThreshold);
  Header h = header_for(1, kBig, kEncMitogenRaw);
  Bytes body = pattern(kBig, 41);
  Bytes f = frame(h, body);

  RxBuffer rx;
  FrameParser p(rx);
  std::size_t consumed = 0;
  std::size_t max_chunks = 0;
  bool checked_half = false;
  std::vector<Message> got;
  for (std::size_t off = 0; off < f.size(); off += 4096) {
    feed(p, f, off, std::min<std::size_t>(4096, f.size() - off));
    for (;;) {
      Message m;
      ParseResult r = p.next(m);
      consumed += r.consumed;
      ASSERT_NE(r.status, ParseStatus::kInvalid) << r.error;
      if (r.status != ParseStatus::kComplete) break;
      got.push_back(std::move(m));
    }
    max_chunks = std::max(max_chunks, rx.chunk_count());
    if (!checked_half && off + 4096 >= kHeaderSize + kBig / 2) {
      checked_half = true;
      EXPECT_LE(rx.chunk_count(), 2u) << "body is accumulating in 128 KiB rx chunks";
      EXPECT_LT(rx.readable(), kChunkSize);
      EXPECT_TRUE(got.empty());
      EXPECT_GE(p.partial_bytes(), kBig / 2);
    }
  }
  EXPECT_TRUE(checked_half);
  EXPECT_LE(max_chunks, 2u);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].header, h);
  ASSERT_EQ(got[0].data.size(), kBig);
  EXPECT_EQ(got[0].data.slices().size(), 1u);
  auto c = got[0].data.contiguous();
  ASSERT_EQ(c.size(), kBig);
  EXPECT_TRUE(std::equal(c.begin(), c.end(), body.begin()));
  // Every byte is reported as consumed once: those that arrived before
  // direct mode when it began, the ones read straight into the body buffer
  // when the frame completes.
  EXPECT_EQ(consumed, f.size());
  EXPECT_EQ(p.buffered(), 0u);
}

TEST(FrameParserTest, LargeBodyViaReadTargetIsOneSlice) {
  // The way a Stream drives the parser: read into read_target(), commit, next().
  Header h = header_for(2, kBig);
  Bytes body = pattern(kBig, 42);
  Bytes f = frame(h, body);
  RxBuffer rx;
  FrameParser p(rx);
  std::vector<Message> got;
  std::size_t off = 0;
  bool direct_seen = false;
  while (off < f.size()) {
    auto dst = p.read_target();
    ASSERT_FALSE(dst.empty());
    std::size_t n = std::min(dst.size(), f.size() - off);
    std::memcpy(dst.data(), f.data() + off, n);
    p.commit(n);
    off += n;
    if (dst.size() > kChunkSize) direct_seen = true;  // reading into the body buffer
    for (;;) {
      Message m;
      ParseResult r = p.next(m);
      ASSERT_NE(r.status, ParseStatus::kInvalid) << r.error;
      if (r.status != ParseStatus::kComplete) break;
      got.push_back(std::move(m));
    }
    EXPECT_LE(rx.chunk_count(), 2u);
  }
  EXPECT_TRUE(direct_seen);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].header, h);
  auto c = got[0].data.contiguous();
  ASSERT_EQ(c.size(), kBig);
  EXPECT_TRUE(std::equal(c.begin(), c.end(), body.begin()));
}

TEST(FrameParserTest, LargeBodyFedInOneGoIsOneSlice) {
  Header h = header_for(3, kBig, kEncMitogen);
  Bytes body = pattern(kBig, 43);
  Bytes f = frame(h, body);
  RxBuffer rx;
  FrameParser p(rx);
  p.feed(f);
  Message m;
  ParseResult r = p.next(m);
  ASSERT_EQ(r.status, ParseStatus::kComplete) << r.error;
  EXPECT_EQ(m.header, h);
  ASSERT_EQ(m.data.size(), kBig);
  EXPECT_EQ(payload_bytes(m.data), body);
  // parser.h: "A larger body gets one buffer of exactly its size".
  EXPECT_EQ(m.data.slices().size(), 1u) << "a body >= kDirectBodyThreshold came back in "
                                        << m.data.slices().size() << " slices";
  auto c = m.data.contiguous();
  ASSERT_EQ(c.size(), kBig);
  EXPECT_TRUE(std::equal(c.begin(), c.end(), body.begin()));
}

TEST(FrameParserTest, FrameAfterDirectBodyInSameFeed) {
  Header h1 = header_for(1, kBig);
  Bytes b1 = pattern(kBig, 51);
  Header h2 = header_for(2, 300, kEncCallError);
  Bytes b2 = pattern(300, 52);
  Header h3 = header_for(3, 0);
  Bytes s = frame(h1, b1);
  for (const Bytes& f : {frame(h2, b2), frame(h3, {})}) s.insert(s.end(), f.begin(), f.end());

  RxBuffer rx;
  FrameParser p(rx);
  // Header + a little body: the parser switches to a direct body.
  feed(p, s, 0, 4096);
  Message m;
  ParseResult r = p.next(m);
  ASSERT_EQ(r.status, ParseStatus::kNeedMore) << r.error;
  EXPECT_EQ(r.consumed, 4096u);
  EXPECT_EQ(rx.readable(), 0u);
  EXPECT_GT(p.read_target().size(), kChunkSize);  // reads now go to the body buffer
  // The rest of the body and two more frames in a single feed.
  feed(p, s, 4096, s.size() - 4096);
  Drain d;
  d.run(p);
  ASSERT_EQ(d.msgs.size(), 3u);
  EXPECT_EQ(d.msgs[0].header, h1);
  EXPECT_EQ(d.msgs[0].body, b1);
  EXPECT_EQ(d.msgs[0].slices, 1u);
  EXPECT_EQ(d.msgs[1].header, h2);
  EXPECT_EQ(d.msgs[1].body, b2);
  EXPECT_EQ(d.msgs[2].header, h3);
  EXPECT_TRUE(d.msgs[2].body.empty());
  EXPECT_EQ(p.buffered(), 0u);
}

TEST(FrameParserTest, DirectBodyAtExactThreshold) {
  const std::size_t n = kDirectBodyThreshold;
  Header h = header_for(4, n);
  Bytes body = pattern(n, 61);
  Bytes f = frame(h, body);
  RxBuffer rx;
  FrameParser p(rx);
  std::vector<Message> got;
  for (std::size_t off = 0; off < f.size(); off += 1000) {
    feed(p, f, off, std::min<std::size_t>(1000, f.size() - off));
    Message m;
    ParseResult r = p.next(m);
    ASSERT_NE(r.status, ParseStatus::kInvalid) << r.error;
    if (r.status == ParseStatus::kComplete) got.push_back(std::move(m));
  }
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].data.slices().size(), 1u);
  EXPECT_EQ(payload_bytes(got[0].data), body);
}

TEST(FrameParserTest, BufferedCountsPartialDirectBody) {
  Header h = header_for(5, kBig);
  Bytes f = frame(h, pattern(kBig, 71));
  RxBuffer rx;
  FrameParser p(rx);
  feed(p, f, 0, 10000);
  Message m;
  std::size_t consumed = p.next(m).consumed;
  EXPECT_TRUE(p.partial());
  EXPECT_EQ(p.partial_bytes(), 10000u - kHeaderSize);
  EXPECT_EQ(consumed + p.buffered(), 10000u);
  feed(p, f, 10000, 5000);
  ParseResult r = p.next(m);
  ASSERT_EQ(r.status, ParseStatus::kNeedMore);
  consumed += r.consumed;
  EXPECT_EQ(p.partial_bytes(), 15000u - kHeaderSize);
  EXPECT_EQ(consumed + p.buffered(), 15000u);
}

// An untrusted peer's large body is charged whole before its buffer is made,
// and only if it fits the peer's allowance: otherwise next() consumes nothing
// and says it waits for memory, and once room is made the same header begins
// the body (stream/parser.h).
TEST(FrameParserTest, AnUntrustedBodyWaitsUntilItFitsTheAllowance) {
  constexpr std::size_t kLimit = 4u << 20;
  auto account = std::make_shared<Account>(kLimit, nullptr);
  account->charge(2u << 20);  // what the peer already holds
  RxBuffer rx;
  FrameParser p(rx);
  p.set_account(account, PeerCharge::kWithinLimits);
  Header h = header_for(1, kBig, kEncMitogenRaw);
  Bytes f = frame(h, pattern(kBig, 7));
  auto put_into = [&](FrameParser& into, std::size_t off, std::size_t n) {  // as a stream reads
    while (n > 0) {
      auto dst = into.read_target();
      std::size_t k = std::min(dst.size(), n);
      std::memcpy(dst.data(), f.data() + off, k);
      into.commit(k);
      off += k;
      n -= k;
    }
  };
  auto put = [&](std::size_t off, std::size_t n) { put_into(p, off, n); };
  put(0, kHeaderSize + 1000);
  Message m;
  ParseResult r = p.next(m);
  EXPECT_EQ(r.status, ParseStatus::kNeedMore);
  EXPECT_TRUE(r.memory_wait) << "3 MiB more does not fit 2 of 4 MiB held";
  EXPECT_EQ(r.consumed, 0u);
  EXPECT_EQ(account->held(), 2u << 20) << "a body that waits is not charged";
  EXPECT_FALSE(p.body_wants_bytes());

  account->release(2u << 20);
  r = p.next(m);
  EXPECT_EQ(r.status, ParseStatus::kNeedMore);
  EXPECT_FALSE(r.memory_wait);
  EXPECT_EQ(r.consumed, kHeaderSize + 1000) << "the body began, with what was buffered";
  EXPECT_EQ(account->held(), kBig) << "charged whole, before it arrived";
  EXPECT_TRUE(p.body_wants_bytes());
  EXPECT_EQ(p.bodies_begun(), 1u);

  put(kHeaderSize + 1000, f.size() - kHeaderSize - 1000);
  r = p.next(m);
  ASSERT_EQ(r.status, ParseStatus::kComplete);
  EXPECT_EQ(payload_bytes(m.data), pattern(kBig, 7));
  p.finish();
  m = {};
  EXPECT_EQ(account->held(), 0u);

  // A trusted peer's body is charged however much it holds.
  account->charge(2u << 20);
  FrameParser trusted(rx);
  trusted.set_account(account, PeerCharge::kAlways);
  put_into(trusted, 0, kHeaderSize + 1000);
  r = trusted.next(m);
  EXPECT_FALSE(r.memory_wait);
  EXPECT_EQ(r.consumed, kHeaderSize + 1000);
  EXPECT_GT(account->held(), kLimit);
}

}  // namespace test_parser
