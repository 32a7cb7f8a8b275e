// The check before unpacking: msgpack-c++ allocates a container's elements
// when it reads the container's header, trusting the count it declares. A
// walk over the bytes first keeps a count of the values still owed; every
// value needs at least one byte, so a count above the bytes left cannot be
// honest and the input is refused before anything is allocated. The walk is
// iterative (no recursion a deep input could overflow) and O(size).
#include "spindle/codec.h"

#include <memory>
#include <string>

namespace spindle::detail {
namespace {

std::uint64_t read_be(const std::uint8_t* p, int n) {
  std::uint64_t v = 0;
  for (int i = 0; i < n; ++i) v = (v << 8) | p[i];
  return v;
}

// "" when `b` holds exactly one msgpack value whose containers declare no
// more elements than there are bytes; otherwise what is wrong.
std::string check_shape(std::span<const std::uint8_t> b) {
  std::uint64_t owed = 1;  // values still to read
  std::size_t i = 0;
  const std::size_t n = b.size();
  auto need = [&](std::uint64_t k) { return k <= n - i; };
  while (owed > 0) {
    if (i >= n) return "truncated";
    const std::uint8_t t = b[i++];
    --owed;
    std::uint64_t skip = 0, children = 0;
    if (t <= 0x7f || t >= 0xe0 || (t >= 0xc0 && t <= 0xc3)) {
      // fixint, nil, bool: nothing follows
    } else if (t >= 0x80 && t <= 0x8f) {
      children = 2 * (t & 0x0f);
    } else if (t >= 0x90 && t <= 0x9f) {
      children = t & 0x0f;
    } else if (t >= 0xa0 && t <= 0xbf) {
      skip = t & 0x1f;
    } else {
      switch (t) {
        case 0xc1: return "byte 0xc1 is never used by msgpack";
        case 0xc4: case 0xc5: case 0xc6: case 0xd9: case 0xda: case 0xdb: {  // bin, str
          int w = (t == 0xc4 || t == 0xd9) ? 1 : (t == 0xc5 || t == 0xda) ? 2 : 4;
          if (!need(w)) return "truncated";
          skip = read_be(&b[i], w);
          i += w;
          break;
        }
        case 0xc7: case 0xc8: case 0xc9: {  // ext 8/16/32: length, type, data
          int w = t == 0xc7 ? 1 : t == 0xc8 ? 2 : 4;
          if (!need(w + 1)) return "truncated";
          skip = read_be(&b[i], w) + 1;
          i += w;
          break;
        }
        case 0xca: skip = 4; break;
        case 0xcb: skip = 8; break;
        case 0xcc: case 0xd0: skip = 1; break;
        case 0xcd: case 0xd1: skip = 2; break;
        case 0xce: case 0xd2: skip = 4; break;
        case 0xcf: case 0xd3: skip = 8; break;
        case 0xd4: skip = 2; break;
        case 0xd5: skip = 3; break;
        case 0xd6: skip = 5; break;
        case 0xd7: skip = 9; break;
        case 0xd8: skip = 17; break;
        case 0xdc: case 0xdd: case 0xde: case 0xdf: {  // array 16/32, map 16/32
          int w = (t == 0xdc || t == 0xde) ? 2 : 4;
          if (!need(w)) return "truncated";
          children = read_be(&b[i], w) * ((t >= 0xde) ? 2 : 1);
          i += w;
          break;
        }
        default: return "unknown type byte";
      }
    }
    if (!need(skip)) return "truncated";
    i += skip;
    owed += children;
    if (owed > n - i) return "a container declares more elements than the input has bytes";
  }
  if (i != n) return "bytes left over after the value";
  return {};
}

}  // namespace

Payload payload_of(msgpack::sbuffer&& buf) {
  auto owner = std::make_shared<msgpack::sbuffer>(std::move(buf));
  Payload p;
  p.append(Slice{owner, reinterpret_cast<const std::uint8_t*>(owner->data()), owner->size()});
  return p;
}

msgpack::object_handle unpack_checked(const Payload& bytes, std::string_view what) {
  std::string joined;
  std::span<const std::uint8_t> b = bytes.contiguous();
  if (b.empty() && !bytes.empty()) {
    joined = bytes.to_string();
    b = {reinterpret_cast<const std::uint8_t*>(joined.data()), joined.size()};
  }
  std::string problem = check_shape(b);
  if (!problem.empty())
    throw DecodeError(std::string(what) + ": not one msgpack value (" + problem + ")");
  try {
    return msgpack::unpack(reinterpret_cast<const char*>(b.data()), b.size());
  } catch (const std::exception& e) {
    throw_decode_error(what, e);
  }
}

void throw_decode_error(std::string_view what, const std::exception& e) {
  throw DecodeError(std::string(what) + ": " + e.what());
}

}  // namespace spindle::detail
