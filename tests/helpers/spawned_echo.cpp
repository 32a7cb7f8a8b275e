// spawned_echo: a child program for spawn_child() tests.
//
// Attaches to its parent over the link spawn_child() set up (a socket on fd 3
// or stdin/stdout), serves an echo handler on handle 3000 (the reply is the
// request's payload) and exits 0 when the parent asks it to shut down.
#include "router/child.h"

namespace {
constexpr std::uint32_t kEcho = 3000;
}

int main() {
  return spindle::run_spawned_child([](spindle::ChildEnv& env) {
    spindle::Router& r = env.router();
    r.add_handler([&r](spindle::Message&& m) { r.reply(m, m.data); }, {}, kEcho);
    env.serve();
    return 0;
  });
}
