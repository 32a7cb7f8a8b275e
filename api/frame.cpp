// Frame header encoding, field by field in big-endian order.
#include "spindle/frame.h"

#include "stream/byte_order.h"

namespace spindle {

bool is_known_enc(std::uint16_t enc) {
  switch (enc) {
    case kEncMitogen:
    case kEncMitogenPickle:
    case kEncMitogenRaw:
    case kEncRaw:
    case kEncCallError:
    case kEncFds:
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
    case kEncFds: return "SF";
    default: return "unknown";
  }
}

HeaderBytes encode_header(const Header& h) {
  HeaderBytes b{};
  be::put16(&b[0], h.enc);
  be::put32(&b[2], h.dst_id);
  be::put32(&b[6], h.src_id);
  be::put32(&b[10], h.auth_id);
  be::put32(&b[14], h.handle);
  be::put32(&b[18], h.reply_to);
  be::put32(&b[22], h.length);
  return b;
}

Header decode_header(const std::uint8_t* p) {
  Header h;
  h.enc = be::get16(p);
  h.dst_id = be::get32(p + 2);
  h.src_id = be::get32(p + 6);
  h.auth_id = be::get32(p + 10);
  h.handle = be::get32(p + 14);
  h.reply_to = be::get32(p + 18);
  h.length = be::get32(p + 22);
  return h;
}

}  // namespace spindle
