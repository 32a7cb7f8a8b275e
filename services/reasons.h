// The reasons a service host gives in dead replies, as named constants so
// callers and tests can match them; docs/PROTOCOL.md section 12 lists each.
// A reason may be followed by ": " and detail (a name, a context id).
#pragma once

#include <string_view>

namespace spindle::services::reason {

inline constexpr std::string_view kMalformed = "malformed service call";
inline constexpr std::string_view kUnsupportedVersion = "unsupported service call version";
inline constexpr std::string_view kUnknownService = "unknown service";
inline constexpr std::string_view kUnknownMethod = "unknown method";
inline constexpr std::string_view kRefused = "refused by service policy";
inline constexpr std::string_view kShuttingDown = "shutting down: the service pool is stopping";
inline constexpr std::string_view kStopDeadline =
    "shutting down: the service pool's stop deadline passed before the call started";
inline constexpr std::string_view kQueueFull = "service queue full";
inline constexpr std::string_view kSelectClosed = "shutting down: the receiver's select is closed";
inline constexpr std::string_view kWrongEncoding = "wrong argument encoding";
inline constexpr std::string_view kNoReply = "the service dropped the call without replying";

}  // namespace spindle::services::reason
