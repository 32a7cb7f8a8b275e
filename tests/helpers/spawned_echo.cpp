// spawned_echo: a child program for spawn_child() tests.
//
// Attaches to its parent over the link spawn_child() set up (a socket on fd 3
// or stdin/stdout), serves an echo handler on handle 3000 (the reply is the
// request's payload) and a handler on 3005 that lists the files its fds
// refer to ("<dev>:<ino>" each, space-separated), and exits 0 when the parent
// asks it to shut down.
#include <dirent.h>
#include <sys/stat.h>

#include <cstdlib>
#include <string>

#include <fmt/format.h>

#include "router/child.h"

namespace {
constexpr std::uint32_t kEcho = 3000;
constexpr std::uint32_t kOpenFiles = 3005;

std::string open_files() {
  std::string out;
  DIR* d = ::opendir("/proc/self/fd");
  if (!d) return "opendir failed";
  for (dirent* e; (e = ::readdir(d));) {
    if (e->d_name[0] == '.') continue;
    const int fd = std::atoi(e->d_name);
    struct stat st;
    if (fd != ::dirfd(d) && ::fstat(fd, &st) == 0) out += fmt::format("{}:{} ", st.st_dev, st.st_ino);
  }
  ::closedir(d);
  return out;
}
}  // namespace

int main() {
  return spindle::run_spawned_child([](spindle::ChildEnv& env) {
    spindle::Router& r = env.router();
    r.add_handler([&r](spindle::Message&& m) { r.reply(m, m.data); }, {}, kEcho);
    r.add_handler([&r](spindle::Message&& m) { r.reply(m, spindle::Payload::copy_of(open_files())); }, {},
                  kOpenFiles);
    env.serve();
    return 0;
  });
}
