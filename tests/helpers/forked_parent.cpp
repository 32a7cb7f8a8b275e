// forked_parent: a parent whose fork holds its children's links, for the test
// that kills it (ApiChild.AChildOutlivesNoParentWhoseForkHoldsItsLink).
//
// Forks a Spindle child that serves until its parent link ends, calls it once,
// then forks a
// plain process that only waits (as a multiprocessing worker would, it
// keeps a copy of every fd, the child's link among them), writes
// "<child pid> <holder pid>\n" to the file argv[1], and waits to be killed.
#include <signal.h>
#include <unistd.h>

#include <cstdio>

#include <spindle/spindle.h>

inline constexpr spindle::method<int()> ping{"ping"};

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: forked_parent OUT\n");
    return 2;
  }
  spindle::Runtime rt({.name = "forked-parent"});
  spindle::Child child = rt.fork_child([](spindle::ChildEnv& env) {
    env.expose(ping, [] { return 1; });
    return env.serve();
  });
  // Attached: its handshake is done (a parent lost during the handshake is
  // the handshake timeout's to notice).
  if (child.call(ping) != 1) return 1;
  const pid_t holder = ::fork();
  if (holder < 0) return 1;
  if (holder == 0) {
    ::alarm(60);
    for (;;) ::pause();
  }
  std::FILE* out = std::fopen(argv[1], "we");
  if (!out) return 1;
  std::fprintf(out, "%d %d\n", static_cast<int>(child.pid()), static_cast<int>(holder));
  std::fclose(out);
  for (;;) ::pause();
}
