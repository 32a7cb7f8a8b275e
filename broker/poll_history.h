// poll_history: whether a thread about to sleep should first poll for what
// it waits for, and for how long.
//
// Role: one record per thread, shared by every wait that polls before it
// sleeps: a leader's wait for its call's answer (broker/loop_lead.cpp) and
// a pool worker's or a Select's wait for its next message (services/
// futex.h). A wake-up is the dearest step of a hand-off on a VM (an
// inter-processor interrupt, and a halted vCPU to restart), so a thread
// whose answer comes within the window pays none; the price is up to the
// window in CPU per wait, and a thread whose polls keep finding nothing
// stops polling for a while: after kMissesToBackOff windows in a row that
// ended without the awaited event it sleeps at once for its next
// kBackOffWaits waits, then polls once to look again. The window stretches
// to what the thread's waits have been taking (Broker::spin_window).
//
// Thread safety: each function acts on the calling thread's record only.
#pragma once

#include <chrono>

namespace spindle::poll_history {

inline constexpr int kMissesToBackOff = 4;
inline constexpr int kBackOffWaits = 15;

// How long the calling thread should poll before it sleeps, from `base`
// (Options::wait_spin); zero while it backs off (that wait counts).
std::chrono::nanoseconds window(std::chrono::nanoseconds base);
// After a window: whether what it waited for came within it.
void polled(bool answered);
// A wait of this thread was answered after `took` (polling or asleep).
void answered_after(std::chrono::nanoseconds took);

}  // namespace spindle::poll_history
