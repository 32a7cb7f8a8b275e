// Report: see report.h. The JSON is written by hand (the schema is five
// fields), so the benches need no JSON library.
#include "bench/report.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <system_error>

#include <fmt/format.h>

namespace spindle::bench {

namespace {

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20)
          out += fmt::format("\\u{:04x}", static_cast<unsigned>(static_cast<unsigned char>(c)));
        else
          out += c;
    }
  }
  return out + "\"";
}

// JSON has no NaN or infinity: those are null.
std::string json_number(std::optional<double> v) {
  if (!v || !std::isfinite(*v)) return "null";
  return fmt::format("{}", *v);  // shortest form that reads back exactly
}

bool valid_name(const std::string& n) {
  return !n.empty() && std::all_of(n.begin(), n.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
  });
}

// Two decimals, or four significant figures when that would show 0.00.
std::string format_ratio(double r) {
  return (std::fabs(r) >= 0.1 || r == 0 ? fmt::format("{:.2f}", r) : format_number(r)) + "x";
}

[[noreturn]] void fail_errno(const std::string& what) {
  throw std::system_error(errno, std::generic_category(), what);
}

}  // namespace

std::string format_number(double v) {
  if (!std::isfinite(v)) return "-";
  const double a = std::fabs(v);
  if (a >= 1000 || (v == std::floor(v) && a < 1e15)) return fmt::format("{:.0f}", v);  // counts
  int decimals = 3 - static_cast<int>(std::floor(std::log10(a)));
  return fmt::format("{:.{}f}", v, std::clamp(decimals, 0, 6));
}

Percentiles percentiles(std::vector<double> v) {
  Percentiles p;
  if (v.empty()) return p;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  p.median = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  const auto i99 = static_cast<std::size_t>(std::ceil(0.99 * static_cast<double>(n))) - 1;
  p.p99 = v[std::min(i99, n - 1)];
  return p;
}

void Report::take_args(int& argc, char** argv) {
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--json") == 0) {
      if (i + 1 >= argc || argv[i + 1][0] == '\0') throw std::invalid_argument(kErrJsonWithoutPath);
      json_path_ = argv[++i];
    } else {
      argv[out++] = argv[i];
    }
  }
  argc = out;
  argv[argc] = nullptr;
}

void Report::add(std::string name, double value, std::string unit, std::optional<double> floor) {
  if (!valid_name(name)) throw std::invalid_argument(fmt::format("{}: '{}'", kErrBadRowName, name));
  for (const ReportRow& r : rows_)
    if (r.name == name) throw std::invalid_argument(fmt::format("{}: '{}'", kErrDuplicateRow, name));
  std::optional<double> ratio;
  if (floor && *floor != 0) ratio = value / *floor;
  rows_.push_back({std::move(name), value, std::move(unit), floor, ratio});
}

void Report::print(std::FILE* out) const {
  std::size_t w[5] = {4, 5, 4, 16, 5};
  const char* head[5] = {"row", "value", "unit", "floor (same run)", "ratio"};
  for (int i = 0; i < 5; ++i) w[i] = std::max(w[i], std::strlen(head[i]));
  std::vector<std::array<std::string, 5>> cells;
  for (const ReportRow& r : rows_) {
    cells.push_back({r.name, format_number(r.value), r.unit, r.floor ? format_number(*r.floor) : "",
                     r.ratio ? format_ratio(*r.ratio) : ""});
    for (int i = 0; i < 5; ++i) w[i] = std::max(w[i], cells.back()[static_cast<std::size_t>(i)].size());
  }
  auto line = [&](const std::string& a, const std::string& b, const std::string& c,
                  const std::string& d, const std::string& e) {
    std::string s = fmt::format("{:<{}}  {:>{}}  {:<{}}  {:>{}}  {:>{}}", a, w[0], b, w[1], c, w[2],
                                d, w[3], e, w[4]);
    while (!s.empty() && s.back() == ' ') s.pop_back();
    std::fprintf(out, "%s\n", s.c_str());
  };
  const std::string rule(w[0] + w[1] + w[2] + w[3] + w[4] + 8, '-');
  std::fprintf(out, "\n%s rows (names stable; --json PATH writes them)\n%s\n", bench_.c_str(),
               rule.c_str());
  line(head[0], head[1], head[2], head[3], head[4]);
  std::fprintf(out, "%s\n", rule.c_str());
  for (const auto& c : cells) line(c[0], c[1], c[2], c[3], c[4]);
  std::fprintf(out, "%s\n", rule.c_str());
  std::fflush(out);
}

std::string Report::json() const {
  std::string s = "{\"rows\": [";
  for (std::size_t i = 0; i < rows_.size(); ++i) {
    const ReportRow& r = rows_[i];
    s += fmt::format("{}\n  {{\"name\": {}, \"value\": {}, \"unit\": {}, \"floor\": {}, \"ratio\": {}}}",
                     i ? "," : "", json_string(r.name), json_number(r.value), json_string(r.unit),
                     json_number(r.floor), json_number(r.ratio));
  }
  return s + "\n]}\n";
}

void Report::finish(std::FILE* out) const {
  print(out);
  if (!json_path_) return;
  const std::string tmp = *json_path_ + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "we");  // "e": O_CLOEXEC
  if (!f) fail_errno("cannot create " + tmp);
  const std::string text = json();
  const bool written = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  const int write_errno = errno;
  if (std::fclose(f) != 0 || !written) {
    if (!written) errno = write_errno;
    fail_errno("cannot write " + tmp);
  }
  if (std::rename(tmp.c_str(), json_path_->c_str()) != 0) fail_errno("cannot rename " + tmp);
  std::fprintf(out, "wrote %zu rows to %s\n", rows_.size(), json_path_->c_str());
}

}  // namespace spindle::bench
