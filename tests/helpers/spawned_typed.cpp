// spawned_typed: a child program for spawn_child() tests of the public API.
//
// Attaches to its parent over the link spawn_child() set up (a socket on fd 3
// or stdin/stdout) and serves, through <spindle/spindle.h> only:
//   fds.write_to(UniqueFd, string) -> long   writes the text to the fd
//   echo(string) -> string
// and exits 0 when the parent asks it to shut down.
#include <unistd.h>

#include <string>

#include <spindle/spindle.h>

namespace {
inline constexpr spindle::method<long(spindle::UniqueFd, std::string)> write_to{"fds.write_to"};
inline constexpr spindle::method<std::string(std::string)> echo{"echo"};
}  // namespace

int main() {
  return spindle::run_spawned_child([](spindle::ChildEnv& env) {
    env.expose(write_to, [](spindle::UniqueFd fd, std::string text) {
      return static_cast<long>(::write(fd.get(), text.data(), text.size()));
    });
    env.expose(echo, [](std::string s) { return s; });
    return env.serve();
  });
}
