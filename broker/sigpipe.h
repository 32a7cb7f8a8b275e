// SIGPIPE handling shared by the broker thread, a leading caller and the
// streams: a write to a closed pipe must come back as EPIPE, never kill the
// process, so the thread that writes blocks SIGPIPE; the write then leaves
// a SIGPIPE pending on that thread, which must be consumed before SIGPIPE
// is unblocked there (or it would be delivered then).
// Thread safety: each acts on the calling thread only (masks are per thread).
#pragma once

#include <signal.h>

namespace spindle::sigpipe {

// A set holding SIGPIPE alone.
sigset_t only();

// Consumes every SIGPIPE pending on the calling thread (it must be blocked).
void consume_pending();

}  // namespace spindle::sigpipe
