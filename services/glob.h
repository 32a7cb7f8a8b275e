// Glob: matches a name against a shell pattern (* ? [...]) in time linear
// in their product at worst.
//
// names.find takes a pattern from any client. glibc's fnmatch backtracks
// through every way of splitting the name among the stars: "*a*a*a...b"
// against "aaaa..." takes exponential time (an audit: one call kept a
// worker and the names table busy for seconds). Here a star never needs
// more than the last one to retry: whatever an earlier star could have
// taken, the later star can take instead, so one remembered position is
// enough (the classic wildcard matcher).
//
// Syntax, as fnmatch without flags: `*` any run of bytes, `?` one byte,
// `[...]` one byte of a set, with ranges `a-z`, `!` or `^` first to negate,
// and `]` first to include it. A `\` makes the next byte literal. A `[`
// with no closing `]` is a literal `[`.
//
// Thread safety: a pure function.
#pragma once

#include <string_view>

namespace spindle::services {

bool glob_match(std::string_view pattern, std::string_view name);

}  // namespace spindle::services
