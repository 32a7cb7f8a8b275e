// sole_owner(p): whether `p` is the only owner of its object, and if so,
// ordered after every other owner's last use of it, so that the caller may
// write to the object (reuse a buffer, move out what it holds).
//
// use_count() alone is a relaxed load. Seeing 1 tells us the others let go,
// but it does not order their last reads of the object (a caller reading
// its reply out of a receive chunk, on its own thread) before our next
// writes to it. Copying the pointer is an acquire-release read-modify-write
// of the same count, which reads the value the last owner's release left:
// that owner's accesses then happen before ours, in the memory model and for
// TSan alike (which found the race in a receive chunk's reuse). The price is
// two atomic operations, paid only where the answer is yes.
//
// Thread safety: as for any shared_ptr read; `p` itself is the caller's.
#pragma once

#include <memory>

namespace spindle {

template <class T>
bool sole_owner(const std::shared_ptr<T>& p) {
  if (p.use_count() != 1) return false;
  std::shared_ptr<T> ordered = p;  // the acquire (see above)
  return true;
}

}  // namespace spindle
