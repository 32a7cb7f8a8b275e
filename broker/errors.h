// Errors: the internal side of <spindle/errors.h>: errno texts and named texts.
//
// Thread safety: plain value types.
#pragma once

#include <exception>
#include <string>
#include <string_view>

#include "spindle/errors.h"

namespace spindle {

// errno's description without strerror()'s locale lookup, which takes a lock
// that a fork() could leave held in the child.
const char* errno_text(int err);

// What a caller is told when a handler or an exposed function throws `e`:
// the type and the text of the CallError it receives. A spindle::CallError
// keeps its own type and message, so a function can answer with a type
// of its choosing (another language's exception, a nested call's failure
// passed on); any other std::exception gives its demangled dynamic type and
// what(). Every place that turns an exception into an error reply uses it.
struct ThrownError {
  std::string type;
  std::string message;
};
ThrownError thrown_error(const std::exception& e);
// The same for whatever the current exception is (inside a catch block),
// including one that is not a std::exception.
ThrownError current_thrown_error();

// Named texts, so tests and peers can match on them.
namespace errtext {
inline constexpr std::string_view kBrokerShutDown = "broker has shut down; the request was not accepted";
inline constexpr std::string_view kCallTimedOut = "call timed out";
inline constexpr std::string_view kSecondLoopThread =
    "hosted runtime: its io_context is run by a second thread; Spindle's handlers run only on "
    "the thread that made the runtime (see <spindle/hosted.h>)";
}  // namespace errtext

}  // namespace spindle
