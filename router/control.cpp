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

std::optional<std::pair<std::uint32_t, std::uint32_t>> parse_id_range(std::string_view s) {
  const auto dash = s.find('-');
  auto first = parse_context_id(s.substr(0, dash));
  if (!first) return std::nullopt;
  if (dash == std::string_view::npos) return std::pair{*first, std::uint32_t{1}};
  auto last = parse_context_id(s.substr(dash + 1));
  if (!last || *last < *first || *last - *first == UINT32_MAX) return std::nullopt;
  return std::pair{*first, *last - *first + 1};
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
