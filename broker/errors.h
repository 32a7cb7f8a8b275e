// Errors: the internal side of <spindle/errors.h>: errno texts and named texts.
//
// Thread safety: plain value types.
#pragma once

#include <string_view>

#include "spindle/errors.h"

namespace spindle {

// errno's description without strerror()'s locale lookup, which takes a lock
// that a fork() could leave held in the child.
const char* errno_text(int err);

// Named texts, so tests and peers can match on them.
namespace errtext {
inline constexpr std::string_view kBrokerShutDown = "broker has shut down; the request was not accepted";
inline constexpr std::string_view kCallTimedOut = "call timed out";
inline constexpr std::string_view kSecondLoopThread =
    "hosted runtime: its io_context is run by a second thread; Spindle's handlers run only on "
    "the thread that made the runtime (see <spindle/hosted.h>)";
}  // namespace errtext

}  // namespace spindle
