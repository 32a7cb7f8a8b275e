// Typed calls to a remote service, so C++ callers never pack an envelope.
//
//   Payload r = services::call(child, "echo", "say", Payload::copy_of("hi"));
//   std::string s = services::call_text(child, "echo", "say", "hi");
//   auto f = services::call_async(child, "echo", "say", Payload::copy_of("hi"));
//   Payload later = f.get().data;
//
// Failures arrive as exceptions: CallError (the method threw: type and
// message), ChannelError (a dead reply: unknown service or method, policy
// refusal, malformed call, shutting down; what() is the reason from
// services/reasons.h), TimeoutError. A bad service or method name throws
// Error before anything is sent.
//
// Thread safety: any thread but the broker's (call blocks; call_async may be
// used anywhere a Context call_async may).
#pragma once

#include <chrono>
#include <future>
#include <string>
#include <string_view>

#include "router/router.h"
#include "spindle/context.h"

namespace spindle::services {

Payload call(const Context& target, std::string_view service, std::string_view method,
             Payload args = {}, std::chrono::milliseconds timeout = Context::kDefaultTimeout);
std::string call_text(const Context& target, std::string_view service, std::string_view method,
                      std::string_view args = {},
                      std::chrono::milliseconds timeout = Context::kDefaultTimeout);
// The future's Message carries the result in .data; get() throws as above.
std::future<Message> call_async(const Context& target, std::string_view service,
                                std::string_view method, Payload args = {},
                                std::chrono::milliseconds timeout = Context::kDefaultTimeout);

}  // namespace spindle::services
