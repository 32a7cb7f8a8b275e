// Memfd ranges (docs/PROTOCOL.md §13.7): bytes that sit in a sealed memfd
// and travel inside a larger message (a reply that wraps a received body)
// pass as a range of that same memfd, with the rest inline, instead of being
// copied into a new one; a large heap slice beside small bytes is copied
// alone. The receiver checks the range against the memfd, and a peer that did
// not announce kFlagMemfdRanges never sees one.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "router/child.h"
#include "router/reasons.h"
#include "router/router.h"
#include "stream/fd_frame.h"
#include "stream/handshake.h"
#include "stream/memfd.h"
#include "tests/fds_test_util.h"
#include "tests/raw_peer.h"
#include "tests/router_test_util.h"
#include "tests/stream_test_util.h"

namespace spindle {
namespace test_memfd_ranges {

using namespace std::chrono_literals;
using namespace testutil;

constexpr std::uint32_t kWrap = 3300, kDescribeSpan = 3301;
constexpr std::size_t kThreshold = 1u << 20;

Payload fabric(std::size_t n, std::uint32_t seed) {
  PayloadBuffer buf(n);
  auto bytes = pattern(n, seed);
  std::memcpy(buf.bytes().data(), bytes.data(), n);
  return std::move(buf).seal();
}

ino_t inode_of(const std::shared_ptr<const SealedMemfd>& m) { return m ? fd_identity(m->fd()).second : 0; }

// "head" + every slice of `middle` + "tail", as one payload of views.
Payload wrapped(const Payload& middle) {
  Payload out = Payload::copy_of(std::string_view("head"));
  for (const Slice& s : middle.slices()) out.append(s);
  const Payload tail = Payload::copy_of(std::string_view("tail"));
  for (const Slice& s : tail.slices()) out.append(s);
  return out;
}

TEST(MemfdRanges, BytesOfAMappedMemfdAreFoundByTheirAddress) {
  Payload p = fabric(2u << 20, 1);
  const std::uint8_t* base = p.contiguous().data();
  auto found = SealedMemfd::mapped_at(base + 100, 1000);
  ASSERT_TRUE(found);
  EXPECT_EQ(found->memfd, p.memfd());
  EXPECT_EQ(found->offset, 100u);
  EXPECT_FALSE(SealedMemfd::mapped_at(base + (2u << 20) - 10, 11)) << "runs past the mapping";
  std::vector<std::uint8_t> heap(4096);
  EXPECT_FALSE(SealedMemfd::mapped_at(heap.data(), heap.size())) << "heap bytes are in no memfd";
}

// map_into() lays the range out among page mappings: at any offset in the
// memfd, with bytes around it shorter or longer than a page, the view is one
// range that reads as head + range + tail, and the range is found again.
TEST(MemfdRanges, AMappedRangeIsOneViewWhateverItsOffsetAndWhatIsAroundIt) {
  Payload body = fabric(64 * 1024, 7);
  const std::string all = body.to_string();
  const std::size_t offsets[] = {0, 1, 4095, 4096, 5000};
  const std::size_t lengths[] = {1, 4096, 20000};
  const std::size_t arounds[] = {0, 3, 4097, 10000};
  for (std::size_t off : offsets)
    for (std::size_t len : lengths)
      for (std::size_t head : arounds)
        for (std::size_t tail : arounds) {
          const std::string around = std::string(head, 'h') + std::string(tail, 't');
          Payload p = body.memfd()->map_into(Payload::copy_of(around), head, off, len);
          ASSERT_EQ(p.contiguous().size(), head + len + tail) << off << " " << len << " " << head << " " << tail;
          ASSERT_TRUE(p.to_string() == std::string(head, 'h') + all.substr(off, len) + std::string(tail, 't'))
              << off << " " << len << " " << head << " " << tail;
          auto found = SealedMemfd::mapped_at(p.contiguous().data(), p.size());
          ASSERT_TRUE(found) << off << " " << len << " " << head << " " << tail;
          EXPECT_EQ(found->skip, head);
          EXPECT_EQ(found->offset, off);
          EXPECT_EQ(found->length, len);
        }
}

TEST(MemfdRanges, ReadyForAMemfdAReceivedRangeIsNotCopied) {
  Payload body = fabric(4u << 20, 2);
  Payload ready = memfd_ready(wrapped(body), kThreshold);
  const MemfdSpan& span = ready.memfd_span();
  EXPECT_EQ(span.memfd, body.memfd()) << "the bytes were copied into another memfd";
  EXPECT_EQ(span.at, 4u);
  EXPECT_EQ(span.offset, 0u);
  EXPECT_EQ(span.length, 4u << 20);
  EXPECT_FALSE(ready.memfd()) << "only a range of the payload is the memfd";
  EXPECT_TRUE(ready.to_string() == wrapped(body).to_string());
}

TEST(MemfdRanges, ReadyForAMemfdALargeHeapSliceIsCopiedAlone) {
  Payload heap = Payload::copy_of(std::string(3u << 20, 'h'));
  Payload ready = memfd_ready(wrapped(heap), kThreshold);
  const MemfdSpan& span = ready.memfd_span();
  ASSERT_TRUE(span.memfd);
  EXPECT_EQ(span.memfd->size(), 3u << 20) << "the memfd holds the slice alone";
  EXPECT_EQ(span.at, 4u);
  EXPECT_TRUE(ready.to_string() == wrapped(heap).to_string());
  // Bytes that are a small part of a large memfd are copied, so that they do
  // not hold the whole memfd in the receiver.
  Payload big = fabric(8u << 20, 3);
  Payload part;
  part.append(Slice{big.slices()[0].owner, big.slices()[0].data + 4096, 3u << 20});
  Payload small_part = memfd_ready(wrapped(part), kThreshold);
  ASSERT_TRUE(small_part.memfd_span().memfd);
  EXPECT_NE(small_part.memfd_span().memfd, big.memfd());
  EXPECT_EQ(small_part.memfd_span().memfd->size(), 3u << 20);
  EXPECT_TRUE(small_part.to_string() == wrapped(part).to_string());
  // Past the threshold beside the largest slice, the whole payload is copied.
  Payload two = Payload::copy_of(std::string(2u << 20, 'a'));
  const Payload b = Payload::copy_of(std::string(3u << 20, 'b'));
  two.append(b.slices()[0]);
  Payload whole = memfd_ready(two, kThreshold);
  ASSERT_TRUE(whole.memfd());
  EXPECT_EQ(whole.memfd()->size(), 5u << 20);
  EXPECT_TRUE(whole.to_string() == two.to_string());
}

// The child wraps what it receives in "head" and "tail" and replies with it,
// or describes how a payload's memfd range arrived: "<at> <length> <memfd
// size> <memfd inode> <contiguous>".
int ranges_child(ChildEnv& env) {
  Router& r = env.router();
  r.add_handler([&r](Message&& m) { r.reply(m, wrapped(m.data)); }, {}, kWrap);
  r.add_handler(
      [&r](Message&& m) {
        const MemfdSpan& s = m.data.memfd_span();
        r.reply(m, Payload::copy_of(s.memfd ? fmt::format("{} {} {} {} {}", s.at, s.length, s.memfd->size(),
                                                          inode_of(s.memfd),
                                                          m.data.contiguous().size() == m.data.size())
                                            : std::string("inline")));
      },
      {}, kDescribeSpan);
  env.serve();
  return 0;
}

TEST(MemfdRangesRouter, AReplyThatWrapsAReceivedBodyPassesTheSameMemfdBack) {
  Broker broker;
  Router router(broker, root_opts());
  Context c = fork_child(router, ranges_child, named("ranges-peer"));
  Payload body = fabric(8u << 20, 4);
  Payload back = c.call(kWrap, body, 20s);
  EXPECT_EQ(inode_of(back.memfd_span().memfd), inode_of(body.memfd()))
      << "the child copied the body into a new memfd";
  EXPECT_EQ(back.memfd_span().at, 4u);
  EXPECT_EQ(back.contiguous().size(), back.size()) << "one view, for a decoder to read in place";
  EXPECT_TRUE(back.to_string() == wrapped(body).to_string());
  // Wrapped once more, with what came around it: the range is found inside
  // the view and goes back as the same memfd again.
  EXPECT_EQ(c.call(kDescribeSpan, wrapped(back), 20s).to_string(),
            fmt::format("8 {} {} {} true", 8u << 20, 8u << 20, inode_of(body.memfd())));
  // A heap slice beside small bytes arrives as a memfd of its own size.
  Payload heap = wrapped(Payload::copy_of(std::string(3u << 20, 'x')));
  const std::string seen = c.call(kDescribeSpan, heap, 20s).to_string();
  EXPECT_TRUE(seen.starts_with(fmt::format("4 {} {} ", 3u << 20, 3u << 20))) << seen;
  EXPECT_TRUE(seen.ends_with(" true")) << seen;
  c.shutdown();
  expect_exit_code(c, 0);
}

// A raw peer that announced memfd ranges sends one ranged SF frame, then a
// plain one; returns why the stream closed ("" if it did not), what it
// refused, and what it delivered.
struct Outcome {
  std::string closed;
  std::vector<std::string> refusals;
  std::vector<Message> delivered;
};
Outcome send_ranged(std::uint16_t announced, const MemfdRange& range, const std::string& around, int memfd,
                    StreamOptions opts = {}) {
  FdRecorder rec;
  StreamHarness h;
  RawPeer peer;
  h.make(peer.router_end, peer.router_end, &rec, opts,
         std::make_unique<ServerHandshake>(0, static_cast<std::uint32_t>(::getpid()), 64u << 20,
                                           [](const PeerInfo&) { return std::uint32_t{7}; }));
  EXPECT_EQ(peer.handshake(announced), 7u);
  const auto desc = encode_memfd_range(range);
  const std::string inline_bytes = std::string(desc.begin(), desc.end()) + around;
  EXPECT_TRUE(send_with_fds(peer.fd, sf_frame(10, 1, inline_bytes, kFdFlagMemfdBody | kFdFlagMemfdRange),
                            std::span<const int>(&memfd, 1)));
  Outcome o;
  o.closed = deliveries_before_end(peer.fd, rec, o.delivered);
  std::lock_guard lk(rec.mu);
  o.refusals = rec.refusals;
  return o;
}

TEST(MemfdRanges, TheReceiverChecksARangeAgainstItsMemfd) {
  Payload body = fabric(64 * 1024, 5);
  const int fd = body.memfd()->fd();
  const std::uint16_t flags = kFlagFdPassing | kFlagMemfdRanges;
  // A good range: "ab" + bytes [100, 1100) of the memfd + "cd".
  Outcome ok = send_ranged(flags, MemfdRange{100, 1000, 2}, "abcd", fd);
  EXPECT_EQ(ok.closed, "");
  ASSERT_EQ(ok.delivered.size(), 1u);
  const Payload& got = ok.delivered[0].data;
  EXPECT_EQ(got.to_string(), "ab" + body.to_string().substr(100, 1000) + "cd");
  EXPECT_EQ(inode_of(got.memfd_span().memfd), inode_of(body.memfd()));
  EXPECT_EQ(got.memfd_span().at, 2u);
  EXPECT_EQ(got.contiguous().size(), got.size()) << "one view, for a decoder to read in place";
  EXPECT_EQ(ok.delivered[0].header.length, 1004u);
  // Past the memfd's end, empty, or placed past the inline bytes: refused,
  // with the reason, and the connection stays.
  for (const MemfdRange& bad : {MemfdRange{64 * 1024 - 10, 11, 0}, MemfdRange{0, 0, 0}, MemfdRange{0, 10, 5},
                                MemfdRange{~0ull, 2, 0}}) {
    Outcome o = send_ranged(flags, bad, "abcd", fd);
    EXPECT_EQ(o.closed, "") << "range at " << bad.offset;
    EXPECT_TRUE(o.delivered.empty());
    ASSERT_EQ(o.refusals.size(), 1u);
    EXPECT_TRUE(contains(o.refusals[0], reason::kBadMemfd)) << o.refusals[0];
  }
  // An untrusted peer's bytes around a range are charged to it, beside its
  // memfd: they must fit its allowance too.
  StreamOptions strict;
  strict.untrusted = true;
  strict.memory_limit = 80 * 1024;
  Outcome fits = send_ranged(flags, MemfdRange{0, 1000, 0}, std::string(4096, 'x'), fd, strict);
  EXPECT_EQ(fits.delivered.size(), 1u) << (fits.refusals.empty() ? fits.closed : fits.refusals[0]);
  Outcome over = send_ranged(flags, MemfdRange{0, 1000, 0}, std::string(32 * 1024, 'x'), fd, strict);
  EXPECT_TRUE(over.delivered.empty());
  ASSERT_EQ(over.refusals.size(), 1u) << over.closed;
  EXPECT_TRUE(contains(over.refusals[0], "around a memfd range do not fit")) << over.refusals[0];
  // A stream that never announced ranges (this peer did not ask for them,
  // and the stream always offers them) still refuses nothing it can read:
  // the flag is known to it. A peer that sends the flag to a side that did
  // not offer it is a protocol error (decode_fd_prefix).
  std::string error;
  const auto prefix = encode_fd_prefix(FdPrefix{kEncRaw, 1, kFdFlagMemfdBody | kFdFlagMemfdRange});
  std::string bytes(prefix.begin(), prefix.end());
  bytes += std::string(kMemfdRangeSize, '\0');
  EXPECT_FALSE(decode_fd_prefix(Payload::copy_of(bytes), error, true, /*ranges=*/false));
  EXPECT_TRUE(contains(error, "unknown flags")) << error;
}

// A peer that takes fds but did not announce kFlagMemfdRanges (an older
// Spindle) is sent a payload with a memfd range inline, bytes and all: the
// range a window of the memfd at a time (tx_queue.h), between the bytes
// around it; here one range starts on a page and one does not, and both
// span several windows.
TEST(MemfdRanges, APeerWithoutRangesGetsTheBytesInline) {
  FdRecorder rec;
  StreamHarness h;
  RawPeer peer;
  Stream* s = h.make(peer.router_end, peer.router_end, &rec, {},
                     std::make_unique<ServerHandshake>(0, static_cast<std::uint32_t>(::getpid()), 64u << 20,
                                                       [](const PeerInfo&) { return std::uint32_t{7}; }));
  EXPECT_EQ(peer.handshake(kFlagFdPassing | kFlagFdBatches), 7u);
  Payload body = fabric(4u << 20, 6);
  const std::string all = body.to_string();
  const std::size_t odd = (2u << 20) + 7;
  const Payload sent[] = {memfd_ready(wrapped(body), kThreshold),
                          body.memfd()->map_into(Payload::copy_of(std::string(5000, 'a') + "tail"), 5000, 5001, odd)};
  const std::string want[] = {wrapped(body).to_string(), std::string(5000, 'a') + all.substr(5001, odd) + "tail"};
  for (std::uint32_t i = 0; i < 2; ++i) {
    ASSERT_TRUE(sent[i].memfd_span().memfd);
    Message m;
    m.header.dst_id = 7;
    m.header.src_id = 0;
    m.header.handle = 4000 + i;
    m.header.length = static_cast<std::uint32_t>(sent[i].size());
    m.data = sent[i];
    h.on([&] {
      s->enqueue(std::move(m), 0);
      s->flush();
    });
    Message got;
    ASSERT_TRUE(peer.read_frame_for(7, 4000 + i, got));
    EXPECT_EQ(got.header.enc, kEncRaw) << "not an SF frame";
    EXPECT_TRUE(got.data.to_string() == want[i]) << "payload " << i;
  }
}

}  // namespace test_memfd_ranges
}  // namespace spindle
