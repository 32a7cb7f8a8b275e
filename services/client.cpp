// The envelope is built around the caller's payload (a header slice, then
// the argument slices), so arguments are never copied on the way out.
#include "services/client.h"

#include "services/envelope.h"
#include "spindle/frame.h"

namespace spindle::services {

Payload call(const Context& target, std::string_view service, std::string_view method, Payload args,
             std::chrono::milliseconds timeout) {
  return target.call(kHandleCallService, encode_call(service, method, std::move(args)), timeout);
}

std::string call_text(const Context& target, std::string_view service, std::string_view method,
                      std::string_view args, std::chrono::milliseconds timeout) {
  return call(target, service, method, Payload::copy_of(args), timeout).to_string();
}

std::future<Message> call_async(const Context& target, std::string_view service,
                                std::string_view method, Payload args,
                                std::chrono::milliseconds timeout) {
  return target.call_async(kHandleCallService, encode_call(service, method, std::move(args)), timeout);
}

}  // namespace spindle::services
