// router_demo: starts the spindle-router program, connects three worker
// processes and this one to it, and has them talk through it.
//
// Each worker registers a name ("upper-0".."upper-2") as it connects and
// serves the typed function `upper`. This process finds the workers by name
// (find("upper-*")), calls each, calls the router's ping service and prints
// the router's stats (what `spindle-ctl stats` shows; both through
// <spindle/router_services.h>), then stops the router with SIGTERM: the
// router tells its clients, the workers' links end, their serve() returns,
// and they exit. Exit status 0 only if every answer was
// right and every process ended cleanly.
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <spindle/spindle.h>

extern char** environ;

namespace {

using namespace spindle;
using namespace std::chrono_literals;

inline constexpr spindle::method<std::string(std::string)> upper{"upper"};

// A worker process: serves `upper` under its name until the router goes away.
[[noreturn]] void worker(const std::string& socket, int index) {
  try {
    Connection conn = Connection::open(socket, {.name = "upper-" + std::to_string(index)});
    conn.expose(upper, [](std::string s) {
      for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
      return s;
    }, Allow::kAnyone);
    conn.serve();  // the router said SHUTDOWN, or went away
    conn.close();  // joins the broker thread before the process ends
    ::_exit(0);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "worker: %s\n", e.what());
    ::_exit(1);
  }
}

// Whether a UNIX socket at `path` accepts a connection (closed at once).
bool accepts(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof addr.sun_path) return false;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  bool ok = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0;
  ::close(fd);
  return ok;
}

}  // namespace

int main() {
  std::string dir = "/tmp/spindle-demo-" + std::to_string(::getpid());
  std::filesystem::create_directory(dir);
  std::filesystem::permissions(dir, std::filesystem::perms::owner_all);
  std::string socket = dir + "/router.sock";
  std::string binary = (std::filesystem::read_symlink("/proc/self/exe").parent_path() / "spindle-router").string();

  std::printf("starting %s --socket %s\n", binary.c_str(), socket.c_str());
  std::vector<char*> argv{binary.data(), const_cast<char*>("--socket"), socket.data(), nullptr};
  pid_t router_pid = -1;
  if (int rc = ::posix_spawn(&router_pid, binary.c_str(), nullptr, nullptr, argv.data(), environ)) {
    std::fprintf(stderr, "cannot start spindle-router: %s\n", std::strerror(rc));
    return 1;
  }
  // Up once its socket accepts. A plain connect() probes it: a Connection
  // would start a broker thread, and the workers are forked below, before
  // this process has any thread.
  bool up = false;
  for (int i = 0; i < 500 && !up; ++i) {
    up = accepts(socket);
    if (!up) std::this_thread::sleep_for(20ms);
  }
  if (!up) {
    std::fprintf(stderr, "spindle-router does not accept on %s\n", socket.c_str());
    return 1;
  }

  std::vector<pid_t> workers;
  for (int i = 0; i < 3; ++i) {  // forked before this process starts any thread
    pid_t p = ::fork();
    if (p == 0) worker(socket, i);
    workers.push_back(p);
  }

  int failures = 0;
  {
    Connection me = Connection::open(socket);
    std::vector<Context> found;
    for (int i = 0; i < 500 && found.size() < workers.size(); ++i) {
      if (i) std::this_thread::sleep_for(10ms);
      found = me.find("upper-*");  // the workers may still be connecting
    }
    std::printf("this process is context %u; find(\"upper-*\") found", me.id());
    for (auto& w : found) std::printf(" %s (context %u)", w.name().c_str(), w.id());
    std::printf("\n");
    failures += found.size() != workers.size();
    for (auto& w : found) {
      std::string text = "hello, " + w.name();
      std::string back = w.call(upper, text);
      std::printf("  upper(\"%s\") at %s -> \"%s\"\n", text.c_str(), w.name().c_str(), back.c_str());
      std::string want = text;
      for (char& c : want) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
      failures += back != want;
    }
    std::string pong = router_ping(me.router_context(), "ping", 10s);
    std::printf("  the router's ping service answered \"%s\"\n", pong.c_str());
    failures += pong != "ping";
    std::printf("\nthe router's stats (spindle-ctl --socket %s stats --raw):\n%s\n", socket.c_str(),
                router_stats(me.router_context(), 10s).c_str());
  }

  std::printf("stopping the router with SIGTERM\n");
  ::kill(router_pid, SIGTERM);
  int st = 0;
  ::waitpid(router_pid, &st, 0);
  std::printf("  spindle-router exited with status %d\n", WIFEXITED(st) ? WEXITSTATUS(st) : -1);
  failures += !(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  for (pid_t p : workers) {
    ::waitpid(p, &st, 0);
    std::printf("  worker pid %d exited with status %d\n", p, WIFEXITED(st) ? WEXITSTATUS(st) : -1);
    failures += !(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  }
  std::filesystem::remove_all(dir);
  std::printf("%s\n", failures ? "FAILED" : "all answers correct; every process exited cleanly");
  return failures ? 1 : 0;
}
