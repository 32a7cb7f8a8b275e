// Message: one frame, its header and its payload.
//
// A Message is a value: cheap to move, and its payload shares received chunks
// rather than copying them (see payload.h). Helpers build the common shapes:
// a reply, a dead reply with a reason, and a CallError reply.
//
// Thread safety: a value type; a const Message may be read from any thread.
#pragma once

#include <string>
#include <string_view>

#include <spindle/fds.h>
#include <spindle/frame.h>
#include <spindle/payload.h>

namespace spindle {

struct Message {
  Header header;
  Payload data;
  // File descriptors passed with the message (at most kMaxFdsPerMessage),
  // closed when the last copy of the message goes. See docs/PROTOCOL.md §13.
  FdSet fds{};
  // In transit only: a body that arrived as a sealed memfd and has not been
  // mapped (a router forwards it as an fd). `data` is empty meanwhile; the
  // router maps it before a local handler sees the message.
  std::shared_ptr<const SealedMemfd> sealed_body{};
  // In a router only: a request from an untrusted peer (a listener's client)
  // to a handler of this process carries the charge its sender pays while
  // the request waits for its answer (docs/PROTOCOL.md §14, calls in flight).
  // Whoever keeps the request keeps the charge; copies share it, and it is
  // released when the last one goes. Never sent.
  std::shared_ptr<const void> sender_charge{};

  bool is_dead() const { return header.is_dead(); }
  bool is_call_error() const { return header.enc == kEncCallError; }
  std::string text() const { return data.to_string(); }

  static Message make(std::uint32_t dst_id, std::uint32_t handle, Payload data,
                      std::uint16_t enc = kEncRaw);
  // A reply to `request`: dst = its src, handle = its reply_to.
  static Message reply_to(const Message& request, Payload data, std::uint16_t enc = kEncRaw);
  // A dead message to `request`'s sender carrying `reason` as raw UTF-8, as
  // Mitogen does (enc "MI", reply_to = IS_DEAD).
  static Message dead_reply(const Message& request, std::string_view reason);
  // A CallError reply: enc "SE", payload "type\0message".
  static Message call_error(const Message& request, std::string_view type, std::string_view what);
  // Whether a failure of `msg` can be reported back to its sender as a dead
  // reply: it asked for a reply and is not itself dead.
  static bool wants_dead_reply(const Message& msg) {
    return msg.header.reply_to != 0 && !msg.is_dead();
  }
};

// Splits an "SE" payload into its type and message.
struct CallErrorText {
  std::string type;
  std::string what;
};
CallErrorText parse_call_error(const Message& msg);

}  // namespace spindle
