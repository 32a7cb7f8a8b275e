// Zygote (internal include): the class is public, <spindle/zygote.h>, which
// says what it is for and how it behaves; router/zygote.cpp says how it
// works (a SOCK_SEQPACKET request per child, clone3(CLONE_PARENT)). This
// header stays for the internals and tests that fork zygote children on a
// bare Router (Zygote::fork_child(Router&, ...)).
//
// Thread safety and ownership: as <spindle/zygote.h>.
#pragma once

#include "router/child.h"
#include "spindle/zygote.h"
