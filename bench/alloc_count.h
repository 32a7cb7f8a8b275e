// Allocation counting for the benches: every bench binary links
// alloc_count.cpp, which replaces the global operator new (all forms) with
// one that counts each call and then allocates with malloc. Benches read the
// counter before and after a timed loop and print allocations per message.
//
// What it counts: calls of operator new (and new[]), the allocations C++
// containers, std::function, shared_ptr and the like make. It does not see
// malloc, mmap or memfd called directly (large payload buffers).
//
// Thread safety: any thread; relaxed atomics (a count, not a synchronisation).
// A forked child inherits the counts at the moment of fork().
#pragma once

#include <cstdint>

namespace spindle::bench {

// operator new calls in this process so far, on every thread.
std::uint64_t allocations();
// operator new calls made by the calling thread so far.
std::uint64_t thread_allocations();

}  // namespace spindle::bench
