// ssh_test_agent: an agent of our own for tests/test_ssh.cpp, started on
// the far side of a real sshd through SshOptions::agent. It is what a user's
// program becomes with run_agent(): the built-in spindle.* names, plus
// functions that let the tests see what only a program of one's own can
// show across ssh:
//   test.sleep_ms(long) -> long              a call still running when ssh dies
//   test.count_to(Sender<long>, long) -> long  values sent back through the
//                                            parent's Receiver (1..n), then n
//   test.stderr_line(std::string) -> bool    one line on the session's stderr,
//                                            which the parent logs
// All keep Allow::kParent: only the parent that started the agent calls them.
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include <spindle/spindle.h>

namespace {

inline constexpr spindle::method<long(long)> sleep_ms{"test.sleep_ms"};
inline constexpr spindle::method<long(spindle::Sender<long>, long)> count_to{"test.count_to"};
inline constexpr spindle::method<bool(std::string)> stderr_line{"test.stderr_line"};

}  // namespace

int main(int argc, char** argv) {
  return spindle::run_agent(argc, argv, [](spindle::ChildEnv& env) {
    env.expose(sleep_ms, [](long ms) {
      // Says so first: a test that kills the session mid-call waits for
      // this line (a log record of the context) instead of guessing.
      std::fprintf(stderr, "test.sleep_ms: sleeping %ld ms\n", ms);
      std::fflush(stderr);
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
      return ms;
    });
    env.expose(count_to, [](spindle::Sender<long> to, long n) {
      for (long i = 1; i <= n; ++i) to.send(i);
      return n;
    });
    env.expose(stderr_line, [](std::string line) {
      // One write of the whole line, so that it reaches the session's
      // stderr as one line however stderr is buffered.
      line += '\n';
      bool ok = std::fwrite(line.data(), 1, line.size(), stderr) == line.size();
      return std::fflush(stderr) == 0 && ok;
    });
  });
}
