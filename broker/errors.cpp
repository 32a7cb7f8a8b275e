#include "broker/errors.h"

#include <cxxabi.h>
#include <string.h>

#include <cstdlib>
#include <typeinfo>

namespace spindle {

const char* errno_text(int err) {
  const char* d = ::strerrordesc_np(err);
  return d ? d : "unknown error";
}

ThrownError thrown_error(const std::exception& e) {
  if (const auto* ce = dynamic_cast<const CallError*>(&e)) return {ce->type(), ce->message()};
  const char* mangled = typeid(e).name();
  int status = 0;
  char* s = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  ThrownError out{status == 0 && s ? s : mangled, e.what()};
  std::free(s);
  return out;
}

ThrownError current_thrown_error() {
  try {
    throw;
  } catch (const std::exception& e) {
    return thrown_error(e);
  } catch (...) {
    return {"unknown exception", "the handler threw something that is not a std::exception"};
  }
}

}  // namespace spindle
