// See glob.h. Each step either advances in the name, or goes back to just
// after the last star with that star taking one more byte: the name is
// walked at most once per star restart, O(|pattern| * |name|) in all.
#include "services/glob.h"

#include <cstddef>
#include <optional>

namespace spindle::services {
namespace {

// The set at pattern[i] == '[': whether c is in it, and where the set ends;
// nullopt when there is no closing ']' (then '[' is a literal).
struct SetMatch {
  bool matched;
  std::size_t next;  // the index after the closing ']'
};

std::optional<SetMatch> match_set(std::string_view p, std::size_t i, unsigned char c) {
  std::size_t j = i + 1;
  bool negate = j < p.size() && (p[j] == '!' || p[j] == '^');
  if (negate) ++j;
  bool found = false;
  bool first = true;
  while (j < p.size() && (p[j] != ']' || first)) {
    first = false;
    unsigned char lo = static_cast<unsigned char>(p[j]);
    if (lo == '\\' && j + 1 < p.size()) lo = static_cast<unsigned char>(p[++j]);
    unsigned char hi = lo;
    if (j + 2 < p.size() && p[j + 1] == '-' && p[j + 2] != ']') {
      j += 2;
      hi = static_cast<unsigned char>(p[j]);
      if (hi == '\\' && j + 1 < p.size()) hi = static_cast<unsigned char>(p[++j]);
    }
    if (lo <= c && c <= hi) found = true;
    ++j;
  }
  if (j >= p.size()) return std::nullopt;
  return SetMatch{found != negate, j + 1};
}

}  // namespace

bool glob_match(std::string_view p, std::string_view n) {
  std::size_t pi = 0, ni = 0;
  std::optional<std::size_t> star_p;  // the pattern index just after the last '*'
  std::size_t star_n = 0;             // where that star's run ends so far
  while (ni < n.size()) {
    if (pi < p.size()) {
      const char pc = p[pi];
      if (pc == '*') {
        star_p = ++pi;
        star_n = ni;
        continue;
      }
      const unsigned char c = static_cast<unsigned char>(n[ni]);
      if (pc == '?') {
        ++pi, ++ni;
        continue;
      }
      if (pc == '[') {
        if (auto set = match_set(p, pi, c)) {
          if (set->matched) {
            pi = set->next, ++ni;
            continue;
          }
        } else if (c == '[') {  // no closing ']': a literal '['
          ++pi, ++ni;
          continue;
        }
      } else {
        const bool escaped = pc == '\\' && pi + 1 < p.size();
        if (static_cast<unsigned char>(escaped ? p[pi + 1] : pc) == c) {
          pi += escaped ? 2 : 1, ++ni;
          continue;
        }
      }
    }
    // A mismatch: the last star takes one more byte, or nothing matches.
    if (!star_p) return false;
    pi = *star_p;
    ni = ++star_n;
  }
  while (pi < p.size() && p[pi] == '*') ++pi;
  return pi == p.size();
}

}  // namespace spindle::services
