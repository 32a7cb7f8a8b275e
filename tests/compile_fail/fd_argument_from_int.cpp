// Must NOT compile: a raw int where the method takes a spindle::UniqueFd
// (the call would otherwise take ownership of, and close, an fd the caller
// still uses). ctest compile_fail.fd_argument_from_int expects the
// static_assert's text.
#include <spindle/spindle.h>

inline constexpr spindle::method<long(spindle::UniqueFd)> take{"take"};

long use(const spindle::Context& c, int fd) { return c.call(take, fd); }
