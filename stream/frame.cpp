// Frame header encoding. Written byte by byte so it is independent of host
// endianness and alignment.
#include "stream/frame.h"

namespace spindle {
namespace {

void put_u16(std::uint8_t* p, std::uint16_t v) {
  p[0] = static_cast<std::uint8_t>(v >> 8);
  p[1] = static_cast<std::uint8_t>(v);
}

void put_u32(std::uint8_t* p, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<std::uint8_t>(v >> (24 - 8 * i));
}

std::uint16_t get_u16(const std::uint8_t* p) {
  return static_cast<std::uint16_t>((p[0] << 8) | p[1]);
}

std::uint32_t get_u32(const std::uint8_t* p) {
  return (std::uint32_t{p[0]} << 24) | (std::uint32_t{p[1]} << 16) |
         (std::uint32_t{p[2]} << 8) | std::uint32_t{p[3]};
}

}  // namespace

bool is_known_enc(std::uint16_t enc) {
  switch (enc) {
    case kEncMitogen:
    case kEncMitogenPickle:
    case kEncMitogenRaw:
    case kEncRaw:
    case kEncCallError:
      return true;
    default:
      return false;
  }
}

std::string_view enc_name(std::uint16_t enc) {
  switch (enc) {
    case kEncMitogen: return "MI";
    case kEncMitogenPickle: return "MJ";
    case kEncMitogenRaw: return "MK";
    case kEncRaw: return "SR";
    case kEncCallError: return "SE";
    default: return "unknown";
  }
}

HeaderBytes encode_header(const Header& h) {
  HeaderBytes b{};
  put_u16(&b[0], h.enc);
  put_u32(&b[2], h.dst_id);
  put_u32(&b[6], h.src_id);
  put_u32(&b[10], h.auth_id);
  put_u32(&b[14], h.handle);
  put_u32(&b[18], h.reply_to);
  put_u32(&b[22], h.length);
  return b;
}

Header decode_header(const std::uint8_t* p) {
  Header h;
  h.enc = get_u16(p);
  h.dst_id = get_u32(p + 2);
  h.src_id = get_u32(p + 6);
  h.auth_id = get_u32(p + 10);
  h.handle = get_u32(p + 14);
  h.reply_to = get_u32(p + 18);
  h.length = get_u32(p + 22);
  return h;
}

}  // namespace spindle
