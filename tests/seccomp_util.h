// forbid_syscall(nr): from now on, system call `nr` kills this process with
// SIGSYS (seccomp). For tests that prove a path makes no such call: run it
// in a forked child, then look at how the child ended.
#pragma once

#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>

namespace spindle::testutil {

// False if this kernel or sandbox refuses the filter.
inline bool forbid_syscall(long nr) {
  sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, static_cast<unsigned>(nr), 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  sock_fprog prog{static_cast<unsigned short>(sizeof filter / sizeof filter[0]), filter};
  return ::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0 &&
         ::syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog) == 0;
}

// Exit status a child uses to say forbid_syscall() failed (the test skips).
inline constexpr int kNoSeccomp = 77;

// How a forked child ended: "" for exit status 0, "skip" for kNoSeccomp,
// otherwise a description.
inline std::string child_outcome(pid_t pid) {
  int st = 0;
  if (::waitpid(pid, &st, 0) != pid) return "waitpid failed";
  if (WIFSIGNALED(st))
    return WTERMSIG(st) == SIGSYS ? "killed by SIGSYS: it made the forbidden system call"
                                  : "killed by signal " + std::to_string(WTERMSIG(st));
  if (WEXITSTATUS(st) == kNoSeccomp) return "skip";
  return WEXITSTATUS(st) == 0 ? "" : "exit status " + std::to_string(WEXITSTATUS(st));
}

}  // namespace spindle::testutil
