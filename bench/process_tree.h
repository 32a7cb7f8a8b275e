// process_tree: this process and every process descended from it, and a
// CPU mask set on each of their threads, for a bench that takes the
// scheduler's placement out of a figure. bench_ssh runs rounds with the
// bench, both ssh clients, sshd, the agent and `cat` all on one CPU: on a
// small VM an unpinned chain of five processes lands differently from one
// second to the next, and a wake-up onto an idle vCPU costs more than the
// work of a hop (bench/README.md, bench_ssh).
//
// Thread safety: call from one thread. A process or thread that ends
// meanwhile is skipped; one that starts meanwhile is missed.
#pragma once

#include <dirent.h>
#include <sched.h>
#include <sys/types.h>

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <system_error>
#include <vector>

namespace spindle::bench {

// Numeric entries of a /proc directory (pids, or tids under task/).
inline std::vector<pid_t> proc_numbers(const std::string& dir) {
  std::vector<pid_t> out;
  DIR* d = ::opendir(dir.c_str());
  if (!d) return out;  // the process is gone
  while (dirent* e = ::readdir(d))
    if (e->d_name[0] >= '0' && e->d_name[0] <= '9') out.push_back(static_cast<pid_t>(std::atoi(e->d_name)));
  ::closedir(d);
  return out;
}

// `root` and every process below it, read from /proc/<pid>/stat (the
// parent pid is the second field after the command's closing parenthesis).
inline std::vector<pid_t> process_tree(pid_t root) {
  std::multimap<pid_t, pid_t> children;
  for (pid_t pid : proc_numbers("/proc")) {
    std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
    std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const auto close = stat.rfind(')');
    if (close == std::string::npos || close + 4 >= stat.size()) continue;  // gone
    children.emplace(static_cast<pid_t>(std::atoi(stat.c_str() + close + 4)), pid);
  }
  std::vector<pid_t> tree{root};
  for (std::size_t i = 0; i < tree.size(); ++i) {
    auto [b, e] = children.equal_range(tree[i]);
    for (auto it = b; it != e; ++it) tree.push_back(it->second);
  }
  return tree;
}

// Sets `mask` on every thread of every process in `pids`. Returns how many
// threads refused it with EPERM (a process of another user, such as a
// privilege-separated sshd child when the bench runs as root without
// CAP_SYS_NICE); any other error throws.
inline int set_tree_affinity(const std::vector<pid_t>& pids, const cpu_set_t& mask) {
  int refused = 0;
  for (pid_t pid : pids)
    for (pid_t tid : proc_numbers("/proc/" + std::to_string(pid) + "/task")) {
      if (::sched_setaffinity(tid, sizeof mask, &mask) == 0 || errno == ESRCH) continue;
      if (errno == EPERM) {
        ++refused;
        continue;
      }
      throw std::system_error(errno, std::generic_category(),
                              "sched_setaffinity(" + std::to_string(tid) + ") of process " + std::to_string(pid));
    }
  return refused;
}

}  // namespace spindle::bench
