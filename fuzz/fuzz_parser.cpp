// Fuzzes FrameParser with arbitrary bytes delivered in arbitrary reads.
//
// The input is a script: a max_message_size, then a sequence of reads, each
// either bytes taken from the input or a run of filler bytes (so bodies past
// kDirectBodyThreshold, which take the direct-body path, are reachable from a
// few bytes of input). The bytes are fed the way a Stream feeds them
// (read_target/commit of a fuzzer-chosen size, then next() until it stops
// completing), and the outcome is checked against a reference decoder that
// sees the whole byte string at once:
//   - the same messages (headers and bodies), in the same order;
//   - no message longer than max_message_size;
//   - the same final status, and the same error for an invalid frame;
//   - consumed bytes never exceed what was fed, and add up exactly to the
//     complete frames plus any direct body begun.
// feed() of the whole string in one go must agree too.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <fuzzer/FuzzedDataProvider.h>

#include "stream/parser.h"

namespace {

using spindle::FrameParser;
using spindle::Header;
using spindle::Message;
using spindle::ParseResult;
using spindle::ParseStatus;

struct Outcome {
  std::vector<std::pair<Header, std::string>> messages;
  ParseStatus last = ParseStatus::kNeedMore;
  std::string error;
};

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "fuzz_parser invariant broken: %s\n", what);
  std::abort();
}

// What any correct parser must make of `bytes`, seen whole.
Outcome reference(const std::vector<std::uint8_t>& bytes, std::uint32_t max) {
  Outcome o;
  std::size_t at = 0;
  while (bytes.size() - at >= spindle::kHeaderSize) {
    Header h = spindle::decode_header(bytes.data() + at);
    if (!spindle::is_known_enc(h.enc) || h.length > max) {
      o.last = ParseStatus::kInvalid;
      return o;
    }
    if (bytes.size() - at - spindle::kHeaderSize < h.length) break;
    const char* body = reinterpret_cast<const char*>(bytes.data() + at + spindle::kHeaderSize);
    o.messages.emplace_back(h, std::string(body, h.length));
    at += spindle::kHeaderSize + h.length;
  }
  return o;
}

// Runs next() until it stops completing; checks each result as it comes.
bool drain(FrameParser& p, Outcome& o, std::size_t& consumed, std::size_t fed, std::uint32_t max) {
  for (;;) {
    Message m;
    ParseResult r = p.next(m);
    consumed += r.consumed;
    if (consumed > fed) fail("consumed more bytes than were fed");
    o.last = r.status;
    if (r.status == ParseStatus::kInvalid) {
      if (r.error.empty()) fail("invalid frame without an error text");
      o.error = r.error;
      return false;
    }
    if (r.status == ParseStatus::kNeedMore) return true;
    if (m.header.length > max || m.data.size() != m.header.length)
      fail("message over the maximum, or its body disagrees with its length");
    o.messages.emplace_back(m.header, m.data.to_string());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  // Small limits reach "too large"; large ones reach the direct-body path.
  const std::uint32_t max = in.ConsumeBool() ? in.ConsumeIntegralInRange<std::uint32_t>(0, 4096)
                                             : in.ConsumeIntegralInRange<std::uint32_t>(0, 1u << 20);
  std::vector<std::vector<std::uint8_t>> reads;
  std::vector<std::uint8_t> all;
  // At most 2 MiB in all: enough for a few direct bodies, fast per run.
  while (in.remaining_bytes() > 0 && reads.size() < 4096 && all.size() < (2u << 20)) {
    std::vector<std::uint8_t> r;
    if (in.ConsumeIntegralInRange<int>(0, 15) == 0) {  // a run of filler bytes
      r.assign(in.ConsumeIntegralInRange<std::size_t>(1, 600 * 1024), in.ConsumeIntegral<std::uint8_t>());
    } else {
      r = in.ConsumeBytes<std::uint8_t>(in.ConsumeIntegralInRange<std::size_t>(1, 64));
    }
    if (r.empty()) break;
    all.insert(all.end(), r.begin(), r.end());
    reads.push_back(std::move(r));
  }

  // Chunked, as a Stream reads: into read_target(), at most the read's size.
  spindle::RxBuffer rx;
  FrameParser chunked(rx, max);
  Outcome got;
  std::size_t consumed = 0, fed = 0;
  bool alive = true;
  for (const auto& r : reads) {
    std::size_t off = 0;
    while (alive && off < r.size()) {
      auto dst = chunked.read_target();
      if (dst.empty()) fail("read_target() is empty");
      std::size_t n = std::min(dst.size(), r.size() - off);
      std::memcpy(dst.data(), r.data() + off, n);
      chunked.commit(n);
      off += n;
      fed += n;
      alive = drain(chunked, got, consumed, fed, max);
    }
    if (!alive) break;
  }

  Outcome want = reference(all, max);
  if (got.messages != want.messages) fail("chunked parse disagrees with the reference");
  if (got.last != want.last) fail("chunked final status disagrees with the reference");
  if (alive) {
    // Every fed byte was consumed, is still buffered, or went straight into a
    // direct body (which only a body of kDirectBodyThreshold or more gets).
    if (consumed + rx.readable() > fed) fail("bytes counted twice");
    std::size_t direct = fed - consumed - rx.readable();
    std::size_t direct_cap = 0;
    for (auto& [h, b] : got.messages)
      if (h.length >= spindle::kDirectBodyThreshold) direct_cap += h.length;
    if (direct > direct_cap + max) fail("bytes lost: neither consumed, buffered nor in a body");
    if (max < spindle::kDirectBodyThreshold && direct != 0) fail("bytes lost below the direct-body size");
  }

  // The same bytes in one feed() give the same result.
  spindle::RxBuffer rx2;
  FrameParser whole(rx2, max);
  whole.feed(all);
  Outcome once;
  std::size_t consumed2 = 0;
  drain(whole, once, consumed2, all.size(), max);
  if (once.messages != got.messages || once.last != got.last || once.error != got.error)
    fail("one feed() disagrees with chunked reads");
  return 0;
}
