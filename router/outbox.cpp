// Space is reserved by moving the tail with one compare-and-swap; a record
// that would straddle the end of the buffer is preceded by a padding record,
// so every record is contiguous. A record's length word is written last
// (release) and read first (acquire): a zero length means "not yet
// published", which is why the consumer zeroes what it has consumed before
// the head moves past it.
#include "router/outbox.h"

#include <sys/mman.h>

#include <cstring>
#include <new>
#include <optional>

#include "broker/futex.h"
#include "broker/wait_hook.h"

namespace spindle {
namespace {

std::size_t round_up8(std::size_t n) { return (n + 7) & ~std::size_t{7}; }

std::atomic<std::uint64_t> g_outbox_serial{1};

// The consumer's head as this thread last read it, for one outbox at a
// time: the head only grows, so an old value only ever understates the
// space, and a producer reads the real one (a cache line the consumer
// writes at every drain) only when the old one says the ring is full.
struct SeenHead {
  std::uint64_t outbox = 0;  // the serial of the outbox it belongs to
  std::uint64_t head = 0;
};
thread_local SeenHead t_seen_head;

std::size_t power_of_two_at_least(std::size_t n) {
  std::size_t p = 4096;
  while (p < n) p <<= 1;
  return p;
}

}  // namespace

// The ring comes from mmap, not from malloc and memset: the kernel's pages
// read as zero (every length word "not yet published") and each is faulted
// in only when a record first reaches it. A process that sends a handful of
// messages in its life (a forked worker) touches a page or two instead of
// the whole megabyte, a fault per 4 KiB that bench_forks showed costing a
// short-lived worker about a third of its life.
Outbox::Outbox(std::size_t capacity)
    : serial_(g_outbox_serial.fetch_add(1, std::memory_order_relaxed)), capacity_(power_of_two_at_least(capacity)) {
  void* p = ::mmap(nullptr, capacity_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  buf_ = static_cast<std::uint8_t*>(p);
}

Outbox::~Outbox() {
  // Messages still in the ring (the broker never drained them) are destroyed.
  drain([](OutboxRecord&, std::span<const std::uint8_t>, Message*) {});
  ::munmap(buf_, capacity_);
}

std::uint32_t Outbox::load_length(std::uint64_t pos) const {
  auto* rh = reinterpret_cast<RecHead*>(buf_ + (pos & (capacity_ - 1)));
  return std::atomic_ref<std::uint32_t>(rh->length).load(std::memory_order_acquire);
}

void Outbox::publish(std::uint64_t pos, std::uint32_t length) {
  auto* rh = reinterpret_cast<RecHead*>(buf_ + (pos & (capacity_ - 1)));
  std::atomic_ref<std::uint32_t>(rh->length).store(length, std::memory_order_release);
}

Outbox::Push Outbox::push(const OutboxRecord& rec, std::span<const std::uint8_t> bytes,
                          Message* msg, std::chrono::milliseconds timeout) {
  const std::size_t body = msg ? sizeof(Message) : bytes.size();
  const std::size_t need = round_up8(sizeof(RecHead) + sizeof(OutboxRecord) + body);
  if (need > capacity_ / 2) return Push::kTooLarge;
  std::uint64_t t;
  std::size_t pad;
  std::optional<std::chrono::steady_clock::time_point> deadline;  // from the first wait
  SeenHead& seen = t_seen_head;
  if (seen.outbox != serial_) seen = SeenHead{serial_, head_.load(std::memory_order_acquire)};
  while (true) {
    t = tail_.load(std::memory_order_relaxed);
    std::size_t off = static_cast<std::size_t>(t & (capacity_ - 1));
    pad = off + need > capacity_ ? capacity_ - off : 0;
    if (t + pad + need - seen.head > capacity_) seen.head = head_.load(std::memory_order_acquire);
    if (t + pad + need - seen.head <= capacity_) {
      if (tail_.compare_exchange_weak(t, t + pad + need, std::memory_order_acq_rel)) break;
      continue;
    }
    // Full: sleep until the consumer gives space back (it bumps space_seq_
    // when it sees waiters; the re-check after announcing closes the race).
    std::uint32_t seq = space_seq_.load();
    space_waiters_.fetch_add(1);
    bool woke = true;
    if (tail_.load() + pad + need - head_.load() > capacity_) {
      if (timeout.count() > 0) {
        if (!deadline) deadline = futex::deadline_after(timeout);
        WaitHook::Around around;  // the thread's hook (the binding's: let the GIL go)
        woke = futex::wait(space_seq_, seq, *deadline);
      } else {
        woke = false;  // may not wait: no sleep, no hook
      }
    }
    space_waiters_.fetch_sub(1);
    if (!woke) return Push::kTimeout;
  }
  if (pad) {
    reinterpret_cast<RecHead*>(buf_ + (t & (capacity_ - 1)))->type = kPad;
    publish(t, static_cast<std::uint32_t>(pad));
  }
  const std::uint64_t pos = t + pad;
  auto* rh = reinterpret_cast<RecHead*>(buf_ + (pos & (capacity_ - 1)));
  rh->type = kFrame;
  auto* r = new (rh + 1) OutboxRecord(rec);
  r->has_message = msg != nullptr;
  r->inline_len = msg ? 0 : static_cast<std::uint32_t>(bytes.size());
  auto* after = reinterpret_cast<std::uint8_t*>(r + 1);
  if (msg) new (after) Message(std::move(*msg));
  else if (!bytes.empty()) std::memcpy(after, bytes.data(), bytes.size());
  publish(pos, static_cast<std::uint32_t>(need));
  return Push::kOk;
}

void Outbox::release(std::uint64_t from, std::uint64_t to) {
  std::size_t a = static_cast<std::size_t>(from & (capacity_ - 1));
  std::size_t n = static_cast<std::size_t>(to - from);
  std::size_t first = std::min(n, capacity_ - a);
  std::memset(buf_ + a, 0, first);
  if (n > first) std::memset(buf_, 0, n - first);
  head_.store(to);  // seq_cst: ordered before the waiter check below
  if (space_waiters_.load() > 0) {
    space_seq_.fetch_add(1);
    futex::wake(space_seq_, 1 << 30);
  }
}

}  // namespace spindle
