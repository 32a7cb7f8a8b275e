// glob_match (services/glob.h), the matcher of names.find: the same answers
// as fnmatch(3) without flags, on every pattern and name drawn from a small
// alphabet, and a pattern that makes fnmatch backtrack exponentially answers
// at once (the test would run for hours otherwise).
#include <fnmatch.h>

#include <random>
#include <string>

#include <gtest/gtest.h>

#include "services/glob.h"

namespace spindle::services {
namespace {

TEST(Glob, AgreesWithFnmatch) {
  struct Case {
    const char* pattern;
    const char* name;
  };
  for (const Case& c : std::initializer_list<Case>{
           {"upper-*", "upper-1"}, {"lower-?", "lower-1"}, {"lower-?", "lower-12"}, {"*", ""},
           {"", ""}, {"", "a"}, {"a*b*c", "axxbyyc"}, {"a*b*c", "axxbyy"}, {"[a-c]x", "bx"},
           {"[!a-c]x", "bx"}, {"[^a-c]x", "dx"}, {"[]a]", "]"}, {"[!]a]", "b"}, {"[a-]", "-"},
           {"\\*", "*"}, {"\\*", "a"}, {"[", "["}, {"a[b", "a[b"}, {"[\\]]", "]"}, {"*.log", "x.log"},
           {"**a", "ba"}, {"*?", ""}, {"?*", "q"}}) {
    EXPECT_EQ(glob_match(c.pattern, c.name), ::fnmatch(c.pattern, c.name, 0) == 0)
        << "pattern " << c.pattern << " name " << c.name;
  }
}

TEST(Glob, AgreesWithFnmatchOnRandomPatterns) {
  std::mt19937 rng(12345);
  const std::string pattern_bytes = "ab*?*[]!-";
  const std::string name_bytes = "ab-]";
  for (int i = 0; i < 200000; ++i) {
    std::string p, n;
    for (int k = std::uniform_int_distribution<>(0, 7)(rng); k > 0; --k)
      p += pattern_bytes[std::uniform_int_distribution<std::size_t>(0, pattern_bytes.size() - 1)(rng)];
    for (int k = std::uniform_int_distribution<>(0, 8)(rng); k > 0; --k)
      n += name_bytes[std::uniform_int_distribution<std::size_t>(0, name_bytes.size() - 1)(rng)];
    ASSERT_EQ(glob_match(p, n), ::fnmatch(p.c_str(), n.c_str(), 0) == 0) << "pattern " << p << " name " << n;
  }
}

TEST(Glob, AHostilePatternAnswersAtOnce) {
  // 31 stars and a final 'b' against 64 'a's: fnmatch tries every way of
  // splitting the name among the stars.
  std::string pattern;
  for (int i = 0; i < 31; ++i) pattern += "*a";
  pattern += "b";
  EXPECT_FALSE(glob_match(pattern, std::string(64, 'a')));
  EXPECT_TRUE(glob_match(pattern, std::string(63, 'a') + "b"));
}

}  // namespace
}  // namespace spindle::services
