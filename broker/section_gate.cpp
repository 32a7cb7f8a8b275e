// A thread's mark is one word per section it is inside: the gate's address,
// 0 when the entry is free. The entries of its slot are a stack (sections
// nest), so enter() and leave() are a store of one word each; only the
// closer reads other threads' slots, and only while it closes.
//
// The order that makes close() safe, in each mode:
//  - asymmetric: a thread stores its mark, then (compiler barrier only)
//    loads closed_; the closer stores closed_, then runs membarrier, then
//    reads the marks. The kernel runs a full barrier on every CPU running a
//    thread of ours between the closer's store and its reads (a thread that
//    is not running passed one when it was switched out), so a thread's
//    mark is either visible to the closer's scan or stored after that
//    barrier, and then its load of closed_ comes later still and sees true.
//  - fences: the same, with a seq_cst fence on both sides (Dekker).
// leave() stores with release and the closer's scan loads with acquire, so
// everything a thread did inside happens before the closer goes on.
#include "broker/section_gate.h"

#include <linux/membarrier.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>

#include "broker/errors.h"
#include "broker/log.h"

namespace spindle {
namespace {

constexpr int kGateNested = 7;
constexpr std::size_t kGateSlots = 1024;

struct alignas(64) GateSlot {
  std::atomic<std::uintptr_t> entry[kGateNested];
  std::atomic<bool> owned;
};
static_assert(sizeof(GateSlot) == 64, "a slot is one cache line");

GateSlot g_gate_slots[kGateSlots];

// Which slots are owned, a bit each: what empty() and the fork handler
// visit, so that neither touches the whole 64 KiB table. Visiting every slot
// cost a forked child 16 page faults in its atfork handler (it wrote each
// slot, and each write to a page shared with the parent copies that page),
// and every closer a read of 1,024 cache lines. A slot's bit is set after
// its claim and before its first mark, and cleared after its marks are
// zeroed, so a slot with a mark always has its bit.
constexpr std::size_t kGateWords = kGateSlots / 64;
std::atomic<std::uint64_t> g_gate_owned[kGateWords];

std::size_t slot_index(const GateSlot* s) { return static_cast<std::size_t>(s - g_gate_slots); }
void set_owned_bit(const GateSlot* s) {
  const std::size_t i = slot_index(s);
  g_gate_owned[i / 64].fetch_or(std::uint64_t{1} << (i % 64), std::memory_order_seq_cst);
}
void clear_owned_bit(const GateSlot* s) {
  const std::size_t i = slot_index(s);
  g_gate_owned[i / 64].fetch_and(~(std::uint64_t{1} << (i % 64)), std::memory_order_seq_cst);
}

// Calls fn(GateSlot&) for each slot whose bit is set, until fn returns
// true; returns whether one did.
template <class F>
bool any_owned_slot(F&& fn) {
  for (std::size_t w = 0; w < kGateWords; ++w)
    for (std::uint64_t bits = g_gate_owned[w].load(std::memory_order_acquire); bits != 0; bits &= bits - 1)
      if (fn(g_gate_slots[w * 64 + static_cast<std::size_t>(__builtin_ctzll(bits))])) return true;
  return false;
}

long gate_membarrier(int cmd) { return ::syscall(SYS_membarrier, cmd, 0, 0); }

bool register_gate_membarrier() {
  if (const char* off = std::getenv("SPINDLE_NO_MEMBARRIER"); off && *off && *off != '0') return false;
  const long cmds = gate_membarrier(MEMBARRIER_CMD_QUERY);
  if (cmds < 0 || !(cmds & MEMBARRIER_CMD_PRIVATE_EXPEDITED)) return false;
  return gate_membarrier(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED) == 0;
}

// The calling thread's slot; null while it has none (the table was full,
// or the thread is exiting). Plain thread-locals, read on every enter();
// GateSlotReturn gives the slot back when the thread exits.
thread_local GateSlot* t_gate_slot = nullptr;
thread_local bool t_gate_tried = false;
thread_local int t_gate_top = 0;  // entries of t_gate_slot in use, from the first
struct GateSlotReturn {
  ~GateSlotReturn() {
    if (!t_gate_slot) return;
    for (auto& e : t_gate_slot->entry) e.store(0, std::memory_order_relaxed);
    clear_owned_bit(t_gate_slot);
    t_gate_slot->owned.store(false, std::memory_order_release);
    t_gate_slot = nullptr;
    t_gate_top = 0;
  }
};
thread_local GateSlotReturn t_gate_return;

GateSlot* claim_gate_slot() {
  t_gate_tried = true;
  (void)&t_gate_return;  // constructed now, so that its destructor runs at the thread's exit
  const std::size_t start = std::hash<std::thread::id>{}(std::this_thread::get_id()) % kGateSlots;
  for (std::size_t i = 0; i < kGateSlots; ++i) {
    GateSlot& s = g_gate_slots[(start + i) % kGateSlots];
    bool expect = false;
    if (!s.owned.load(std::memory_order_relaxed) &&
        s.owned.compare_exchange_strong(expect, true, std::memory_order_acquire)) {
      set_owned_bit(&s);
      return t_gate_slot = &s;
    }
  }
  return nullptr;
}

GateSlot* my_gate_slot() {
  if (t_gate_slot) return t_gate_slot;
  return t_gate_tried ? nullptr : claim_gate_slot();
}

// In a forked child the other threads are gone, and with them any section
// they were in. Only owned slots are written (see g_gate_owned). A thread
// that forked between its claim and its bit leaves that slot owned in the
// child with no mark in it: one slot of the table lost there, nothing more.
void clear_other_gate_slots_in_child() {
  any_owned_slot([](GateSlot& s) {
    if (&s != t_gate_slot) {
      for (auto& e : s.entry) e.store(0, std::memory_order_relaxed);
      s.owned.store(false, std::memory_order_relaxed);
      clear_owned_bit(&s);
    }
    return false;  // every one
  });
}

// Set up while the library loads, before any gate is used (a gate used
// earlier, by another library's static initialiser, enters with a fence).
struct GateMode {
  bool asymmetric;
  GateMode() : asymmetric(register_gate_membarrier()) {
    // Only ENOMEM; said on stderr, since the logger may not exist yet.
    if (int rc = ::pthread_atfork(nullptr, nullptr, clear_other_gate_slots_in_child); rc != 0)
      std::fprintf(stderr, "spindle: pthread_atfork: %s: a forked child may wait for a section "
                   "of a thread that stayed in its parent\n", std::strerror(rc));
  }
};
const GateMode g_gate_mode;

inline void gate_enter_barrier() {
  if (g_gate_mode.asymmetric) std::atomic_signal_fence(std::memory_order_seq_cst);
  else std::atomic_thread_fence(std::memory_order_seq_cst);
}

// The closer's side of the barrier (see the top of the file).
void gate_close_barrier() {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (!g_gate_mode.asymmetric) return;
  if (gate_membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED) == 0) return;
  // Registration is inherited across fork and redone by every exec's
  // static initialisation; should it still be missing, register again.
  const int err = errno;
  if (err == EPERM && gate_membarrier(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED) == 0 &&
      gate_membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED) == 0)
    return;
  log().error("section gate: membarrier failed ({}): a thread entering now may be missed", errno_text(err));
}

}  // namespace

bool SectionGate::asymmetric() noexcept { return g_gate_mode.asymmetric; }

SectionGate::Ticket SectionGate::enter() noexcept {
  GateSlot* s = my_gate_slot();
  Ticket t = kShared;
  if (s && t_gate_top < kGateNested) {
    t = t_gate_top++;
    s->entry[t].store(reinterpret_cast<std::uintptr_t>(this), std::memory_order_relaxed);
    gate_enter_barrier();
  } else {
    shared_.fetch_add(1, std::memory_order_seq_cst);
  }
  if (!closed_.load(std::memory_order_acquire)) return t;
  leave(t);
  return kRefused;
}

void SectionGate::leave(Ticket t) noexcept {
  if (t == kShared) {
    shared_.fetch_sub(1, std::memory_order_release);
    return;
  }
  t_gate_slot->entry[t].store(0, std::memory_order_release);
  // Scopes end in the reverse order of their start, so this is the top one;
  // should another order ever happen, the stack still shrinks correctly.
  while (t_gate_top > 0 && t_gate_slot->entry[t_gate_top - 1].load(std::memory_order_relaxed) == 0)
    --t_gate_top;
}

void SectionGate::close() noexcept {
  closed_.store(true, std::memory_order_seq_cst);
  gate_close_barrier();
}

bool SectionGate::empty() const noexcept {
  if (shared_.load(std::memory_order_acquire) != 0) return false;
  const auto self = reinterpret_cast<std::uintptr_t>(this);
  return !any_owned_slot([self](const GateSlot& s) {
    for (const auto& e : s.entry)
      if (e.load(std::memory_order_acquire) == self) return true;
    return false;
  });
}

void SectionGate::close_and_wait() noexcept {
  close();
  // Sections are short (a send, a call): look often at first, then nap.
  for (int looks = 0; !empty(); ++looks) {
    if (looks < 64) sched_yield();
    else ::usleep(looks < 1000 ? 50 : 1000);
  }
}

}  // namespace spindle
