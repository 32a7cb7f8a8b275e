// Fuzzes a root Router with arbitrary frames from an arbitrary peer: the
// fuzzed child of fuzz/router_harness.h writes either raw bytes or a run of
// frames whose header fields the fuzzer picks (known and unknown encodings,
// ids that are its own, its sibling's, the root's or anyone's, control and
// dynamic handles, dead and ordinary reply_to, lengths right or wrong), in
// reads of fuzzer-chosen sizes. The harness then checks that the sibling is
// still served, that the fuzzed link closes on EOF, and that the call pending
// at the fuzzed peer completes.
#include <cstdint>
#include <string>

#include <fuzzer/FuzzedDataProvider.h>

#include "fuzz/router_harness.h"

namespace {

using namespace spindle;

std::uint32_t pick_id(FuzzedDataProvider& in) {
  static constexpr std::uint32_t kIds[] = {0, fuzz::kFuzzedId, fuzz::kSiblingId, 3, 0xffffffff};
  if (in.ConsumeIntegralInRange<int>(0, 7) == 0) return in.ConsumeIntegral<std::uint32_t>();
  return in.PickValueInArray(kIds);
}

std::string one_frame(FuzzedDataProvider& in, std::uint32_t pending) {
  static constexpr std::uint16_t kEncs[] = {kEncMitogen, kEncMitogenPickle, kEncMitogenRaw,
                                            kEncRaw, kEncCallError};
  static constexpr std::uint32_t kHandles[] = {kHandleForwardLog, kHandleAddRoute, kHandleDelRoute,
                                               kHandleAllocateId, kHandleShutdown,
                                               kHandleCallService, fuzz::kEcho, 4321};
  Header h;
  h.enc = in.ConsumeIntegralInRange<int>(0, 15) == 0 ? in.ConsumeIntegral<std::uint16_t>()
                                                     : in.PickValueInArray(kEncs);
  h.dst_id = pick_id(in);
  bool honest = in.ConsumeIntegralInRange<int>(0, 3) != 0;
  h.src_id = honest ? fuzz::kFuzzedId : pick_id(in);
  h.auth_id = honest ? fuzz::kFuzzedId : pick_id(in);
  switch (in.ConsumeIntegralInRange<int>(0, 3)) {
    case 0: h.handle = pending; break;
    case 1: h.handle = in.ConsumeIntegral<std::uint32_t>(); break;
    default: h.handle = in.PickValueInArray(kHandles);
  }
  switch (in.ConsumeIntegralInRange<int>(0, 3)) {
    case 0: h.reply_to = 0; break;
    case 1: h.reply_to = kHandleIsDead; break;
    default: h.reply_to = in.ConsumeIntegralInRange<std::uint32_t>(1000, 1100);
  }
  std::string body = in.ConsumeRandomLengthString(256);
  std::string bytes = testutil::frame_bytes(h, body);
  if (in.ConsumeIntegralInRange<int>(0, 15) == 0) {  // a lying length
    HeaderBytes hb = encode_header([&] {
      Header l = h;
      l.length = in.ConsumeIntegral<std::uint32_t>();
      return l;
    }());
    bytes.replace(0, kHeaderSize, reinterpret_cast<const char*>(hb.data()), hb.size());
  }
  return bytes;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  fuzz::RouterHarness h;
  std::string stream;
  if (in.ConsumeBool()) {
    stream = in.ConsumeRemainingBytesAsString();
  } else {
    while (in.remaining_bytes() > 0 && stream.size() < 64 * 1024) stream += one_frame(in, h.pending_handle());
  }
  // Written in pieces, so the router sees frames split across reads.
  std::size_t at = 0;
  while (at < stream.size()) {
    std::size_t n = std::min<std::size_t>(stream.size() - at, 1 + (stream[at] & 0x7f) * 3);
    if (!h.send(std::string_view(stream).substr(at, n))) break;
    at += n;
  }
  h.finish();
  return 0;
}
