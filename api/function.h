// UniqueFunction: a move-only, type-erased callable that stores small
// callables inline.
//
// Role: the completion of a pending call, and other callbacks on hot paths,
// where std::function would allocate for any capture beyond two pointers and
// cannot hold move-only state (a promise, a coroutine handle, an Asio
// handler). Callables up to kInline bytes (and no stricter alignment than a
// pointer's pair) live inside the object; larger ones go to the heap once.
//
// Thread safety: none (a value). Ownership: owns its callable.
#pragma once

#include <cstddef>
#include <new>
#include <type_traits>
#include <utility>

namespace spindle {

template <class Sig, std::size_t kInline = 48>
class UniqueFunction;

template <class R, class... Args, std::size_t kInline>
class UniqueFunction<R(Args...), kInline> {
 public:
  UniqueFunction() = default;
  UniqueFunction(std::nullptr_t) {}
  template <class F, class D = std::decay_t<F>,
            class = std::enable_if_t<!std::is_same_v<D, UniqueFunction> &&
                                     std::is_invocable_r_v<R, D&, Args...>>>
  UniqueFunction(F&& f) {  // NOLINT: implicit, like std::function
    if constexpr (fits<D>()) {
      new (&buf_) D(std::forward<F>(f));
      ops_ = &inline_ops<D>;
    } else {
      *reinterpret_cast<D**>(&buf_) = new D(std::forward<F>(f));
      ops_ = &heap_ops<D>;
    }
  }
  UniqueFunction(UniqueFunction&& o) noexcept : ops_(o.ops_) {
    if (ops_) ops_->move(&buf_, &o.buf_);
    o.ops_ = nullptr;
  }
  UniqueFunction& operator=(UniqueFunction&& o) noexcept {
    if (this != &o) {
      reset();
      ops_ = o.ops_;
      if (ops_) ops_->move(&buf_, &o.buf_);
      o.ops_ = nullptr;
    }
    return *this;
  }
  UniqueFunction(const UniqueFunction&) = delete;
  UniqueFunction& operator=(const UniqueFunction&) = delete;
  ~UniqueFunction() { reset(); }

  explicit operator bool() const { return ops_ != nullptr; }
  R operator()(Args... args) { return ops_->call(&buf_, std::forward<Args>(args)...); }
  void reset() {
    if (ops_) ops_->destroy(&buf_);
    ops_ = nullptr;
  }

 private:
  using Buf = std::aligned_storage_t<kInline, alignof(std::max_align_t)>;
  struct Ops {
    R (*call)(void*, Args&&...);
    void (*move)(void* dst, void* src);  // into raw storage; src is left destroyed
    void (*destroy)(void*);
  };
  template <class D>
  static constexpr bool fits() {
    return sizeof(D) <= kInline && alignof(D) <= alignof(std::max_align_t) &&
           std::is_nothrow_move_constructible_v<D>;
  }
  template <class D>
  static constexpr Ops inline_ops{
      [](void* p, Args&&... a) -> R { return (*static_cast<D*>(p))(std::forward<Args>(a)...); },
      [](void* dst, void* src) {
        new (dst) D(std::move(*static_cast<D*>(src)));
        static_cast<D*>(src)->~D();
      },
      [](void* p) { static_cast<D*>(p)->~D(); }};
  template <class D>
  static constexpr Ops heap_ops{
      [](void* p, Args&&... a) -> R { return (**static_cast<D**>(p))(std::forward<Args>(a)...); },
      [](void* dst, void* src) { *static_cast<D**>(dst) = *static_cast<D**>(src); },
      [](void* p) { delete *static_cast<D**>(p); }};

  Buf buf_;
  const Ops* ops_ = nullptr;
};

}  // namespace spindle
