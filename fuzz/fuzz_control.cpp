// Fuzzes the control payloads: parse_context_id against a reference, and
// ADD_ROUTE, DEL_ROUTE, FORWARD_LOG, SHUTDOWN, ALLOCATE_ID, dead replies and
// CallError replies sent by a child to a root Router (fuzz/router_harness.h)
// with honest headers and fuzzer-chosen payloads: ids as decimal text (with or
// without ":name", signs, spaces, overflow), raw bytes, NUL-separated log
// records. After announcing routes it also sends to them, so routes a child
// announced are exercised, then the harness checks its invariants. The first
// byte picks the sender: a child, or a listener's client (untrusted, the
// surface spindle-router offers to any process of its uid).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>

#include <fuzzer/FuzzedDataProvider.h>

#include "fuzz/router_harness.h"
#include "router/control.h"

namespace {

using namespace spindle;

// Decimal digits only, no sign, fits a u32.
std::optional<std::uint32_t> reference_id(const std::string& s) {
  if (s.empty() || s.size() > 10) return std::nullopt;
  std::uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + static_cast<std::uint64_t>(c - '0');
  }
  if (v > 0xffffffffull) return std::nullopt;
  return static_cast<std::uint32_t>(v);
}

std::string id_text(FuzzedDataProvider& in) {
  switch (in.ConsumeIntegralInRange<int>(0, 3)) {
    case 0: return std::to_string(in.ConsumeIntegralInRange<std::uint32_t>(0, 8));
    case 1: return std::to_string(in.ConsumeIntegral<std::uint32_t>()) + ":" + in.ConsumeRandomLengthString(16);
    case 2: return std::to_string(in.ConsumeIntegralInRange<std::uint32_t>(0, 64)) + ":child";
    default: return in.ConsumeRandomLengthString(24);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  std::string text = in.ConsumeRandomLengthString(24);
  if (parse_context_id(text) != reference_id(text)) {
    std::fprintf(stderr, "parse_context_id disagrees with the reference on '%s'\n", text.c_str());
    std::abort();
  }
  Message d = dead_message(text);
  if (!d.is_dead() || d.text() != text) std::abort();

  fuzz::RouterHarness h(kFlagNone,
                        in.ConsumeBool() ? fuzz::FuzzedLink::kClient : fuzz::FuzzedLink::kChild);
  const std::uint32_t me = h.fuzzed_id();
  std::string stream;
  while (in.remaining_bytes() > 0 && stream.size() < 64 * 1024) {
    Header f = testutil::frame(0, me, me, 0, 0, kEncMitogen);
    std::string body;
    switch (in.ConsumeIntegralInRange<int>(0, 8)) {
      case 0: f.handle = kHandleAddRoute; body = id_text(in); break;
      case 1: f.handle = kHandleDelRoute; body = id_text(in); break;
      case 2: {
        f.handle = kHandleForwardLog;
        body = in.ConsumeRandomLengthString(16);
        if (in.ConsumeBool()) body += '\0' + std::to_string(in.ConsumeIntegral<int>()) + '\0';
        body += in.ConsumeRandomLengthString(64);
        break;
      }
      case 3: f.handle = kHandleShutdown; f.reply_to = in.ConsumeBool() ? 1001 : 0; break;
      case 4: f.handle = kHandleAllocateId; f.reply_to = in.ConsumeBool() ? 1002 : 0; break;
      case 5:  // a dead reply to the root's pending call
        f.handle = h.pending_handle();
        f.reply_to = kHandleIsDead;
        body = in.ConsumeRandomLengthString(64);
        break;
      case 6:  // a CallError reply (type NUL message, or no NUL at all)
        f.enc = kEncCallError;
        f.handle = h.pending_handle();
        body = in.ConsumeRandomLengthString(64);
        break;
      case 7:  // a message from, or to, a context the peer may have announced
        f.enc = kEncRaw;
        f.src_id = f.auth_id = in.ConsumeIntegralInRange<std::uint32_t>(0, 8);
        f.dst_id = in.ConsumeIntegralInRange<std::uint32_t>(0, 8);
        f.handle = in.ConsumeBool() ? fuzz::kEcho : 4321;
        f.reply_to = in.ConsumeIntegralInRange<std::uint32_t>(0, 1);
        if (f.reply_to) f.reply_to = 1003;
        body = in.ConsumeRandomLengthString(32);
        break;
      default:  // a control message routed elsewhere
        f.dst_id = in.ConsumeIntegralInRange<std::uint32_t>(0, 8);
        f.handle = in.ConsumeIntegralInRange<std::uint32_t>(kHandleForwardLog, kHandleShutdown);
        body = id_text(in);
    }
    stream += testutil::frame_bytes(f, body);
  }
  h.send(stream);
  h.finish();
  return 0;
}
