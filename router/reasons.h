// The reasons a router gives in dead replies. Named constants, so peers and
// tests can match them; docs/PROTOCOL.md lists each one. A reason may be
// followed by ": " and detail (a context id, a size, the stream's close reason).
#pragma once

#include <string_view>

#include "stream/fd_frame.h"

namespace spindle::reason {

inline constexpr std::string_view kNoRoute = "no route to context";
inline constexpr std::string_view kInvalidHandle = "invalid handle";
inline constexpr std::string_view kRefusedByPolicy = "refused by policy";
inline constexpr std::string_view kUnexpectedRespondent = "reply from unexpected context";
inline constexpr std::string_view kTooLarge = "message too large";
inline constexpr std::string_view kPeerDisconnected = "peer disconnected";
inline constexpr std::string_view kShuttingDown = "shutting down";
inline constexpr std::string_view kReversePath = "reverse-path check failed";
inline constexpr std::string_view kUnidirectional = "refused: unidirectional routing forbids reaching a sibling";
inline constexpr std::string_view kQueueFull = "output queue full";
inline constexpr std::string_view kUndecodable = "the receiver cannot decode this encoding";
// File descriptors (docs/PROTOCOL.md §13); the stream names the first five.
inline constexpr std::string_view kFdsLost = fdreason::kFdsLost;
inline constexpr std::string_view kFdsUnsupported = fdreason::kFdsUnsupported;
inline constexpr std::string_view kTooManyFds = fdreason::kTooManyFds;
inline constexpr std::string_view kFdSendFailed = fdreason::kSendFailed;
inline constexpr std::string_view kBadMemfd = fdreason::kBadMemfd;
inline constexpr std::string_view kFdQuota = "fd quota exceeded";
// Accounting and authority (docs/PROTOCOL.md §14, §2.10).
inline constexpr std::string_view kMemoryLimit = "over the memory limit";
inline constexpr std::string_view kIdsExhausted = "context ids exhausted: no id is free";
inline constexpr std::string_view kNotYourId = "refused: the id was not allocated to this link";
inline constexpr std::string_view kNotFromCallee = "reply from unexpected context";
inline constexpr std::string_view kClientLogsRefused =
    "log lines from router clients are not accepted (--accept-client-logs)";
// Routes and SHUTDOWN pass only between adjacent contexts (and log lines
// only up): each side speaks for itself, never another context through it.
inline constexpr std::string_view kNotAdjacent =
    "refused: this control message is accepted only from the adjacent context itself";
inline constexpr std::string_view kOwnRoute =
    "refused: a link cannot delete the route to its own context (it leaves by closing)";

}  // namespace spindle::reason
