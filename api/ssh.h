// Remote contexts over OpenSSH: a child context on another host, started
// through the real `ssh` client, with nothing installed there first.
//
//   spindle::Runtime rt;
//   spindle::Child box = rt.ssh("build-7", {.user = "ci", .port = 2222});
//   auto out = box.call<std::string>("spindle.echo", std::string("hi"));
//
// Runtime::ssh() runs `ssh [options] host <bootstrap>` with its stdin and
// stdout as the link, so the remote side speaks the ordinary frame protocol.
// The bootstrap is one POSIX shell command line: it checks the remote
// system and architecture against this agent's, then runs the agent cached
// as ~/.cache/spindle/spindle-agent-<sha256> if it is there and intact;
// otherwise the parent uploads its own agent binary through the same
// session (written to a temporary name, verified, renamed atomically) and
// runs that. Each stderr line of the session becomes a log line of the
// context. docs/REMOTE.md has the details and what is trusted.
//
// The remote context is an ordinary context: it has an id and a route and
// takes calls, sends and Select. Fds cannot cross hosts (a message with fds
// gets a dead reply that says so), and large payloads are streamed across
// the link in bounded pieces. When the session ends, pending calls fail at
// once with a ChannelError that carries ssh's exit status and its last
// stderr line.
//
// The agent (tools/spindle_agent.cpp) serves the names below. A program of
// your own becomes an agent by calling run_agent() from main() and exposing
// more functions; point SshOptions::agent at it.
//   spindle.echo(std::string) -> std::string   the same bytes back
//   spindle.info() -> std::tuple<std::string, long, std::string, long>
//       [host name, pid, machine (uname -m), peak RSS in bytes]
//   spindle.ssh(...)                            a hop (SshOptions::via)
//   spindle.fork(std::string name) -> std::tuple<long, std::string>
//       [id, name] of a child forked on that host, serving the same names;
//       reach it with Runtime::context(id, name)
//
// Thread safety: Runtime::ssh() may be called from any thread but the
// broker's; it blocks until the agent has answered its handshake (or
// SshOptions::connect_timeout has passed, or ssh has failed).
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include <spindle/child.h>
#include <spindle/context.h>

namespace spindle {

struct SshOptions {
  std::string user;                   // -l USER; empty: ssh's choice
  int port = 0;                       // -p PORT; 0: ssh's choice
  std::string identity_file;          // -i FILE
  std::vector<std::string> ssh_args;  // passed to ssh as they are, before the host
  // Bounds the whole start: ssh's ConnectTimeout, the upload and the
  // agent's handshake. Past it, the start fails with a clear error.
  std::chrono::milliseconds connect_timeout{10000};
  // Reuse (or start) a ControlMaster at this path: later sessions to the
  // same host skip the key exchange. Empty: no multiplexing.
  std::string control_path;
  bool batch_mode = true;             // BatchMode=yes: never a password prompt
  std::string ssh_program = "ssh";    // looked up on PATH
  // The agent binary to run there (uploaded if missing). Empty: $SPINDLE_AGENT,
  // else the installed spindle-agent, else one beside this program.
  std::string agent;
  // Where the remote side caches agents; relative paths are below $HOME.
  std::string remote_dir = ".cache/spindle";
  std::string name;                   // default "ssh:<host>"
  // Start the session from this context instead of from this process: the
  // hop. Messages route through it (an empty Context: from here).
  Context via;
  std::chrono::milliseconds grace{5000};  // as ChildOptions::grace
  RouterOptions router;                   // the agent's router settings
};

// In a program meant to run as an agent: attaches to the link the bootstrap
// gives it (stdin and stdout), lets `setup` expose more functions (it may be
// empty), and serves them and the built-in names until its parent says
// SHUTDOWN or the session ends. Returns the process exit code.
using AgentSetup = std::function<void(ChildEnv&)>;
int run_agent(int argc, char** argv, AgentSetup setup = {});

}  // namespace spindle
