// Control payloads: the text formats of the control handles and dead
// messages, parsed and built in one place (see docs/PROTOCOL.md, section 6).
//
// Thread safety: pure functions.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>
#include <utility>

#include <spdlog/common.h>

#include "spindle/message.h"

namespace spindle {

// A context id in ASCII decimal, as ADD_ROUTE, DEL_ROUTE and ALLOCATE_ID
// carry it. Rejects empty input, signs, spaces and trailing bytes.
std::optional<std::uint32_t> parse_context_id(std::string_view s);

// ALLOCATE_ID's answer to a request for a block: "first-last" (inclusive),
// or one id alone (a root that grants one id, or predates blocks). Returns
// the first id and the count; rejects last < first and malformed text.
std::optional<std::pair<std::uint32_t, std::uint32_t>> parse_id_range(std::string_view s);

// A dead message carrying `reason`, addressed nowhere yet (for local failure).
Message dead_message(std::string_view reason);

// FORWARD_LOG's Python logging level number to spdlog's level.
spdlog::level::level_enum level_from_python(int levelno);

}  // namespace spindle
