// Report: the rows a bench measured, as a table for people and as JSON for
// scripts (scripts/bench.sh, comparisons between runs).
//
// Role: each bench keeps its own printed output (targets, notes) and also
// adds one row per figure here: a stable name, the value, its unit, and the
// floor measured in the same run (if any). The ratio is always value / floor,
// computed here so every bench derives it the same way. finish() prints the
// rows as a table and, when the bench was given `--json PATH`, writes
//   {"rows": [{"name": .., "value": .., "unit": .., "floor": .., "ratio": ..}]}
// to PATH (floor and ratio null when there is no floor; a value that is not a
// finite number is written as null).
//
// Thread safety: one thread (the bench's main).
// Ownership: a plain value owned by the bench's main().
#pragma once

#include <cstdio>
#include <optional>
#include <string>
#include <vector>

namespace spindle::bench {

inline constexpr const char* kErrJsonWithoutPath = "--json needs a file path";
inline constexpr const char* kErrDuplicateRow = "duplicate row name";
inline constexpr const char* kErrBadRowName = "a row name is letters, digits and _";

struct ReportRow {
  std::string name;
  double value = 0;
  std::string unit;
  std::optional<double> floor;
  std::optional<double> ratio;  // value / floor
};

class Report {
 public:
  // `bench` names the program in the table's title ("bench_core").
  explicit Report(std::string bench) : bench_(std::move(bench)) {}

  // Removes `--json PATH` from argv (so the bench's own parser sees the rest)
  // and remembers PATH. Throws std::invalid_argument if PATH is missing.
  void take_args(int& argc, char** argv);
  const std::optional<std::string>& json_path() const { return json_path_; }

  // Throws std::invalid_argument on a duplicate or malformed name.
  void add(std::string name, double value, std::string unit,
           std::optional<double> floor = std::nullopt);

  const std::vector<ReportRow>& rows() const { return rows_; }

  // The rows as an aligned table (name, value, unit, floor, ratio).
  void print(std::FILE* out = stdout) const;
  // The JSON document described above.
  std::string json() const;
  // Prints the table; writes the JSON if --json was given (via a temporary
  // file renamed into place). Throws std::runtime_error if it cannot write.
  void finish(std::FILE* out = stdout) const;

 private:
  std::string bench_;
  std::optional<std::string> json_path_;
  std::vector<ReportRow> rows_;
};

// The median and 99th percentile of a sample (e.g. round trips in us).
struct Percentiles {
  double median = 0, p99 = 0;
};
Percentiles percentiles(std::vector<double> v);

// A number as the table shows it: 4 significant figures, no exponent for
// the magnitudes benches produce.
std::string format_number(double v);

}  // namespace spindle::bench
