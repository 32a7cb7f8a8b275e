// Command-line parsing shared by spindle-router and spindle-ctl.
//
// Long options only ("--name value" or "--name=value"). Sizes take an optional
// K, M or G suffix (powers of 1024); durations take "ms" or "s" (a bare number
// is seconds). Every bad value is a UsageError that names the option and says
// what was expected: the programs print it and exit 2.
//
// Thread safety: plain functions; main thread. Ownership: Args borrows argv.
#pragma once

#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

#include <fmt/format.h>
#include <spdlog/common.h>

namespace spindle::tools {

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Splits "--name=value": leaves "--name" in `a` and returns "value"
// (nullopt, and `a` untouched, without an '=').
inline std::optional<std::string> split_value(std::string& a) {
  const auto eq = a.find('=');
  if (eq == std::string::npos) return std::nullopt;
  std::string v = a.substr(eq + 1);
  a.resize(eq);
  return v;
}

class Args {
 public:
  Args(int argc, char** argv) : argc_(argc), argv_(argv) {}
  // The next "--option" (its "=value" part kept for value()), or nullopt at the end.
  std::optional<std::string> next_option() {
    if (i_ >= argc_) return std::nullopt;
    std::string a = argv_[i_++];
    if (a.rfind("--", 0) != 0) throw UsageError(fmt::format("unexpected argument '{}'", a));
    inline_value_ = split_value(a);
    return a;
  }
  std::string value(const std::string& option) {
    if (inline_value_) return *std::exchange(inline_value_, std::nullopt);
    if (i_ >= argc_) throw UsageError(fmt::format("{} needs a value", option));
    return argv_[i_++];
  }

 private:
  int argc_;
  char** argv_;
  int i_ = 1;
  std::optional<std::string> inline_value_;
};

inline std::uint64_t parse_size(const std::string& option, std::string_view v, std::uint64_t min,
                                std::uint64_t max) {
  std::uint64_t n = 0;
  auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
  std::string_view suffix(end, static_cast<std::size_t>(v.data() + v.size() - end));
  std::uint64_t mult = suffix.empty() ? 1
                       : suffix == "K" || suffix == "k" ? 1024
                       : suffix == "M" || suffix == "m" ? 1024 * 1024
                       : suffix == "G" || suffix == "g" ? 1024ull * 1024 * 1024
                                                        : 0;
  if (ec != std::errc() || mult == 0 || end == v.data())
    throw UsageError(fmt::format("{}: '{}' is not a number (optionally with K, M or G)", option, v));
  if (n > max / mult || n * mult < min || n * mult > max)
    throw UsageError(fmt::format("{}: '{}' is out of range ({} to {})", option, v, min, max));
  return n * mult;
}

inline std::chrono::milliseconds parse_duration(const std::string& option, std::string_view v) {
  double n = 0;
  auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
  std::string_view unit(end, static_cast<std::size_t>(v.data() + v.size() - end));
  double ms = unit == "ms" ? n : (unit.empty() || unit == "s") ? n * 1000 : -1;
  // from_chars reads "nan" and "inf" too. NaN fails every comparison, so a
  // bare `ms < 0` let it through to the cast below, which is undefined for
  // it: only a finite number is a duration.
  if (ec != std::errc() || end == v.data() || !std::isfinite(ms) || ms < 0 || ms > 86400e3)
    throw UsageError(
        fmt::format("{}: '{}' is not a duration (e.g. 500ms, 10s; at most a day)", option, v));
  return std::chrono::milliseconds(static_cast<std::int64_t>(ms));
}

inline spdlog::level::level_enum parse_level(const std::string& option, std::string_view v) {
  for (int l = spdlog::level::trace; l <= spdlog::level::off; ++l) {
    auto lv = static_cast<spdlog::level::level_enum>(l);
    if (spdlog::level::to_string_view(lv) == v) return lv;
  }
  if (v == "warn") return spdlog::level::warn;
  throw UsageError(fmt::format(
      "{}: '{}' is not a level (trace, debug, info, warn, error, critical, off)", option, v));
}

}  // namespace spindle::tools
