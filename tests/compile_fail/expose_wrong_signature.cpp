// Must NOT compile: the lambda takes a string where the method says long.
// ctest compile_fail.expose_wrong_signature expects the static_assert's text.
#include <spindle/spindle.h>

inline constexpr spindle::method<long(long)> square{"square"};

int child_main(spindle::ChildEnv& env) {
  env.expose(square, [](std::string s) { return static_cast<long>(s.size()); });
  return env.serve();
}
