// Fuzzes the service envelope decoder (services/envelope.h) with arbitrary
// bytes split into arbitrary slices, the way a payload spans receive chunks.
//
// Checks: the verdict and every decoded field are the same however the bytes
// are sliced; an accepted envelope has version 1, only defined flags (the
// msgpack bit), names of 1..255 bytes without NUL, and re-encodes to
// exactly the input bytes; a rejected one carries a reason.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include <fuzzer/FuzzedDataProvider.h>

#include "services/envelope.h"

namespace {

using namespace spindle;
using namespace spindle::services;

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "fuzz_envelope invariant broken: %s\n", what);
  std::abort();
}

// `bytes` as a payload of slices cut at `cuts` (each slice its own owner).
Payload sliced(const std::string& bytes, const std::vector<std::size_t>& cuts) {
  Payload p;
  std::size_t at = 0, ci = 0;
  while (at < bytes.size()) {
    std::size_t n = std::min(bytes.size() - at, ci < cuts.size() ? cuts[ci++] : bytes.size());
    auto owner = std::make_shared<std::string>(bytes.substr(at, n));
    p.append(Slice{owner, reinterpret_cast<const std::uint8_t*>(owner->data()), owner->size()});
    at += n;
  }
  return p;
}

bool valid_name(const std::string& n) {
  return !n.empty() && n.size() <= kMaxNameLength && n.find('\0') == std::string::npos;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  std::vector<std::size_t> cuts;
  for (int i = in.ConsumeIntegralInRange<int>(0, 24); i > 0; --i)
    cuts.push_back(in.ConsumeIntegralInRange<std::size_t>(1, 300));
  const std::string bytes = in.ConsumeRemainingBytesAsString();

  DecodeResult whole = decode_call(Payload::copy_of(bytes));
  DecodeResult split = decode_call(sliced(bytes, cuts));
  if (whole.ok() != split.ok() || whole.error != split.error)
    fail("the verdict depends on the slicing");
  if (!whole.ok()) return 0;
  const Envelope& a = whole.envelope;
  const Envelope& b = split.envelope;
  if (a.service != b.service || a.method != b.method || a.flags != b.flags ||
      a.args.to_string() != b.args.to_string())
    fail("decoded fields depend on the slicing");
  if ((a.flags & ~kEnvelopeMsgpack) != 0) fail("accepted an undefined flag");
  if (!valid_name(a.service) || !valid_name(a.method)) fail("accepted a malformed name");
  if (static_cast<std::uint8_t>(bytes[0]) != kEnvelopeVersion) fail("accepted another version");
  if (encode_call(a.service, a.method, b.args, a.flags).to_string() != bytes)
    fail("an accepted envelope does not re-encode to its bytes");
  return 0;
}
