// FdCloser: closes received fds whose close() may wait, on a thread of its
// own, so that no peer can make a broker or pool thread wait in close().
//
// A TCP socket with SO_LINGER on, whose send buffer its owner filled towards
// a peer that never reads, makes the close() of its last reference wait in
// the kernel for up to the linger time, blocking or not. A hostile client
// passes such a socket to a context that does not exist and closes its own
// copy: the router, refusing the message, dropped the last reference on its
// broker thread and stopped for the whole linger (an audit measured 31 s
// with a linger of 30). Only such sockets are handed over (one getsockopt
// per received fd at its close); everything else closes where it is
// dropped, as before. Files on FUSE or NFS may also wait in close(); they
// are not detected (docs/DESIGN.md, Known limitations).
//
// What is handed over keeps its charge (the peer's fd account, the fd
// budget) until it is really closed: a peer that sends many such sockets
// spends its own budget, then gets "fd budget spent".
//
// Thread safety: close_received() from any thread. The closing thread is
// started on first use, and again in a forked child (it checks its pid,
// and never touches a lock the parent may have held across fork()).
// Ownership: takes the fds and the charge it is given.
#pragma once

#include <memory>
#include <vector>

#include "spindle/fds.h"

namespace spindle::fd_closer {

// Closes `fds`: those whose close may wait on the closing thread (then
// releases `charge`), the others here and now (`charge` released when the
// last of them is closed, wherever that is).
// Never throws: if the hand-over fails (no memory, no thread), it closes
// here, as before.
void close_received(std::vector<UniqueFd> fds, std::shared_ptr<void> charge) noexcept;

}  // namespace spindle::fd_closer
