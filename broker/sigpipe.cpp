// sigpipe.h: the SIGPIPE set, and consuming a pending SIGPIPE with a
// zero-timeout sigtimedwait (it returns at once when none is pending).
#include "broker/sigpipe.h"

#include <time.h>

namespace spindle::sigpipe {

sigset_t only() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGPIPE);
  return set;
}

void consume_pending() {
  const sigset_t set = only();
  struct timespec zero {};
  while (::sigtimedwait(&set, nullptr, &zero) == SIGPIPE) {
  }
}

}  // namespace spindle::sigpipe
