// run_agent(): the remote side of an ssh session (see <spindle/ssh.h>).
//
// The bootstrap execs the agent with the link on stdin/stdout
// (SPINDLE_FD=stdio); from there it is an ordinary child context: it
// answers the parent's handshake, serves the built-in names and whatever the
// program's setup exposes, on four threads of its own (a slow call, or a
// hop's start, does not hold up the others), and ends when its parent says
// SHUTDOWN or the session ends. The hops it starts for spindle.ssh and the
// children it forks for spindle.fork (copies of itself on its host, serving
// the same names) are its children: they end with it.
//
// spindle.echo answers with the argument's own bytes (the argument array's
// one element, sliced out): no copy, so a 64 MiB echo costs the agent the
// received body once.
#include <unistd.h>
#include <sys/resource.h>
#include <sys/utsname.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "broker/errors.h"
#include "broker/log.h"
#include "router/child.h"
#include "router/child_internal.h"
#include "router/ssh.h"
#include "router/ssh_bootstrap.h"
#include "spindle/method.h"

namespace spindle {
namespace {

inline constexpr method<std::tuple<long, std::string>(std::string, std::vector<std::string>)> kSsh{
    "spindle.ssh"};
inline constexpr method<std::tuple<long, std::string>(std::string)> kFork{"spindle.fork"};

// The argument array [x] without its one-byte header is x's encoding.
Payload echo(const Payload& args) {
  auto slices = args.slices();
  if (args.size() < 2 || slices.empty() || slices[0].data[0] != 0x91)
    throw Error("spindle.echo takes exactly one argument");
  Payload out;
  bool first = true;
  for (const Slice& s : slices) {
    Slice part = s;
    if (first) {
      ++part.data;
      --part.size;
      first = false;
    }
    if (part.size) out.append(std::move(part));
  }
  return out;
}

std::tuple<std::string, long, std::string, long> info() {
  struct utsname u {};
  if (::uname(&u) != 0) throw Error(std::string("uname: ") + errno_text(errno));
  struct rusage ru {};
  if (::getrusage(RUSAGE_SELF, &ru) != 0) throw Error(std::string("getrusage: ") + errno_text(errno));
  return {u.nodename, static_cast<long>(::getpid()), u.machine, ru.ru_maxrss * 1024L};
}

// What every agent serves, and what its forks serve too.
int serve_agent(ChildEnv& env, const AgentSetup& setup) {
  std::mutex children_mu;
  std::vector<Context> children;  // hops' ssh processes and forks: this process's children
  auto keep = [&](Context c) {
    std::tuple<long, std::string> r{static_cast<long>(c.id()), c.name()};
    std::lock_guard lk(children_mu);
    children.push_back(std::move(c));
    return r;
  };
  // Harmless to anyone who can reach this context, and both answer on the
  // thread that receives the call (the broker): no hand-off to a worker and
  // back, which would cost more than they do.
  env.expose_on_receiver("spindle.echo", Allow::kAnyone, echo);
  env.expose_on_receiver("spindle.info", Allow::kAnyone, [](const Payload&) {
    return detail::encode_value<std::tuple<std::string, long, std::string, long>>(info());
  });
  // These start processes: only the contexts above this one may ask (the
  // root asks a hop to start the next hop).
  Router& router = env.router();
  env.expose(kSsh, [&](std::string host, std::vector<std::string> words) {
    SshOptions o = decode_hop_options(words);
    o.agent = own_executable();
    return keep(ssh_child(router, host, o));
  }, Allow::kUpstream);
  env.expose(kFork, [&](std::string name) {
    ChildOptions co;
    co.name = std::move(name);
    return keep(fork_child(router, [&setup](ChildEnv& child) { return serve_agent(child, setup); }, co));
  }, Allow::kUpstream);
  if (setup) setup(env);
  // Until SHUTDOWN, or the session is gone; then the children go too (the
  // broker's end tells them and reaps them).
  return env.serve(Pool{.threads = 4});
}

}  // namespace

int run_agent(int argc, char** argv, AgentSetup setup) {
  if (argc > 1 && std::strcmp(argv[1], "--version") == 0) {
    std::printf("spindle-agent (Spindle)\n");
    return 0;
  }
  const char* fdspec = std::getenv("SPINDLE_FD");
  if (!fdspec || std::strcmp(fdspec, "stdio") != 0) {
    std::fprintf(stderr, "%s: this program is the remote side of spindle::Runtime::ssh() and is started "
                 "by its bootstrap, with the link on stdin and stdout (SPINDLE_FD=stdio)\n",
                 argc > 0 ? argv[0] : "spindle-agent");
    return 2;
  }
  RouterOptions opts;
  if (const char* n = std::getenv("SPINDLE_CONTEXT_NAME")) opts.name = n;
  int read_fd = -1, write_fd = -1;
  try {
    detail::take_stdio_link(read_fd, write_fd);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "spindle-agent: %s\n", e.what());
    return 1;
  }
  return detail::run_child(
      read_fd, write_fd, opts, [&setup](ChildEnv& env) { return serve_agent(env, setup); },
      /*close_when_drained=*/true);
}

}  // namespace spindle
