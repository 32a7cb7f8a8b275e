// The counting global operator new / operator delete (see alloc_count.h).
// Replacing them is the standard's own hook ([replacement.functions]): the
// definitions below are used by the whole program, libspindle included.
#include "bench/alloc_count.h"

#include <atomic>
#include <cstdlib>
#include <new>

namespace {

std::atomic<std::uint64_t> g_allocations{0};
// constinit: a plain TLS word, no initialisation guard, so reading it inside
// operator new can never itself allocate.
constinit thread_local std::uint64_t t_allocations = 0;

void count() {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  ++t_allocations;
}

void* allocate(std::size_t n) {
  count();
  if (n == 0) n = 1;
  for (;;) {
    if (void* p = std::malloc(n)) return p;
    std::new_handler h = std::get_new_handler();
    if (!h) throw std::bad_alloc();
    h();
  }
}

void* allocate_aligned(std::size_t n, std::align_val_t al) {
  count();
  std::size_t align = static_cast<std::size_t>(al);
  if (align < sizeof(void*)) align = sizeof(void*);
  if (n == 0) n = 1;
  for (;;) {
    void* p = nullptr;
    if (::posix_memalign(&p, align, n) == 0) return p;
    std::new_handler h = std::get_new_handler();
    if (!h) throw std::bad_alloc();
    h();
  }
}

template <typename F>
void* nothrow(F f) noexcept {
  try {
    return f();
  } catch (...) {
    return nullptr;
  }
}

}  // namespace

namespace spindle::bench {

std::uint64_t allocations() { return g_allocations.load(std::memory_order_relaxed); }
std::uint64_t thread_allocations() { return t_allocations; }

}  // namespace spindle::bench

void* operator new(std::size_t n) { return allocate(n); }
void* operator new[](std::size_t n) { return allocate(n); }
void* operator new(std::size_t n, std::align_val_t al) { return allocate_aligned(n, al); }
void* operator new[](std::size_t n, std::align_val_t al) { return allocate_aligned(n, al); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  return nothrow([n] { return allocate(n); });
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
  return nothrow([n] { return allocate(n); });
}
void* operator new(std::size_t n, std::align_val_t al, const std::nothrow_t&) noexcept {
  return nothrow([n, al] { return allocate_aligned(n, al); });
}
void* operator new[](std::size_t n, std::align_val_t al, const std::nothrow_t&) noexcept {
  return nothrow([n, al] { return allocate_aligned(n, al); });
}

void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
