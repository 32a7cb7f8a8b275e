// method<R(A...)>: a typed function that one context exposes and others call.
//
// Declared once, in a header both sides include:
//   inline constexpr spindle::method<long(long)> square{"square"};
// The callee exposes it (ChildEnv::expose), the caller calls it
// (Context::call, call_async, async_call). The signature is checked at
// compile time on both sides: a lambda that cannot be called as R(A...) is
// a compile error, and so is a call with arguments that do not convert.
//
// The name is what travels (docs/PROTOCOL.md section 12.3): "service.method",
// or a bare "method", which lives in the service kDefaultService. A peer in
// another language calls it by that name with msgpack arguments.
//
// Thread safety: a constant.
#pragma once

#include <string_view>

namespace spindle {

// The service that a method name without a dot belongs to.
inline constexpr std::string_view kDefaultService = "fn";

template <class Signature>
class method;

template <class R, class... A>
class method<R(A...)> {
 public:
  using result_type = R;
  explicit constexpr method(std::string_view name) : name_(name) {}
  constexpr std::string_view name() const { return name_; }

 private:
  std::string_view name_;
};

}  // namespace spindle
