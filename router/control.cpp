#include "router/control.h"

#include <charconv>

namespace spindle {

std::optional<std::uint32_t> parse_context_id(std::string_view s) {
  // At most 10 digits (4294967295): no run of leading zeros is an id.
  if (s.size() > 10) return std::nullopt;
  std::uint32_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || p != s.data() + s.size()) return std::nullopt;
  return v;
}

Message dead_message(std::string_view reason) {
  Message d = Message::make(0, 0, Payload::copy_of(reason), kEncMitogen);
  d.header.reply_to = kHandleIsDead;
  return d;
}

spdlog::level::level_enum level_from_python(int levelno) {
  if (levelno >= 50) return spdlog::level::critical;
  if (levelno >= 40) return spdlog::level::err;
  if (levelno >= 30) return spdlog::level::warn;
  if (levelno >= 20) return spdlog::level::info;
  if (levelno >= 10) return spdlog::level::debug;
  return spdlog::level::trace;
}

}  // namespace spindle
