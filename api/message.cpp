#include "spindle/message.h"

namespace spindle {

Message Message::make(std::uint32_t dst_id, std::uint32_t handle, Payload data,
                      std::uint16_t enc) {
  Message m;
  m.header.enc = enc;
  m.header.dst_id = dst_id;
  m.header.handle = handle;
  m.data = std::move(data);
  return m;
}

Message Message::reply_to(const Message& request, Payload data, std::uint16_t enc) {
  return make(request.header.src_id, request.header.reply_to, std::move(data), enc);
}

Message Message::dead_reply(const Message& request, std::string_view reason) {
  Message m = make(request.header.src_id, request.header.reply_to, Payload::copy_of(reason),
                   kEncMitogen);
  m.header.reply_to = kHandleIsDead;
  return m;
}

Message Message::call_error(const Message& request, std::string_view type,
                            std::string_view what) {
  std::string body;
  body.reserve(type.size() + 1 + what.size());
  body.append(type).push_back('\0');
  body.append(what);
  return reply_to(request, Payload::copy_of(body), kEncCallError);
}

CallErrorText parse_call_error(const Message& msg) {
  std::string s = msg.text();
  auto nul = s.find('\0');
  if (nul == std::string::npos) return {"CallError", s};
  return {s.substr(0, nul), s.substr(nul + 1)};
}

}  // namespace spindle
