// <spindle/asio.h>: typed calls with Asio completion tokens (opt-in).
//
//   long r = co_await child.async_call(square, 9, asio::use_awaitable);
//   child.async_call(square, 9, [](std::exception_ptr e, long r) { ... });
//   std::future<long> f = child.async_call(square, 9, asio::use_future);
//   auto op = child.async_call(square, 9, asio::deferred);  // sent when awaited
//
// Every form goes through one initiation (asio::async_initiate) over the
// library's one compiled seam, Context::start_call. The completion
// signature is void(std::exception_ptr, R) (void(std::exception_ptr) for a
// void method):
//  - it runs on the handler's associated executor (the system executor for
//    a plain callback), never on Spindle's broker thread;
//  - a work guard keeps that executor's loop alive while the call is pending;
//  - a cancellation slot bound to the handler (asio::bind_cancellation_slot,
//    or a coroutine's) completes the call at once with operation_aborted as
//    a std::system_error. The request already sent still runs remotely; its
//    reply is dropped when it comes.
//
// Thread safety: as Context. Requires standalone Asio (find_package(spindle
// COMPONENTS asio) gives the spindle::asio target).
#pragma once

#include <atomic>
#include <cstddef>
#include <exception>
#include <memory>
#include <string>
#include <system_error>
#include <tuple>
#include <type_traits>
#include <utility>

#include <asio/associated_cancellation_slot.hpp>
#include <asio/associated_executor.hpp>
#include <asio/async_result.hpp>
#include <asio/error.hpp>
#include <asio/executor_work_guard.hpp>
#include <asio/post.hpp>

#include <spindle/context.h>

namespace spindle::detail {

template <class R, class Handler>
class AsioCall {
 public:
  using Executor = asio::associated_executor_t<Handler>;
  using Slot = asio::associated_cancellation_slot_t<Handler>;

  explicit AsioCall(Handler&& h)
      : slot_(asio::get_associated_cancellation_slot(h)),
        work_(asio::make_work_guard(asio::get_associated_executor(h))),
        handler_(std::move(h)) {}

  Slot& slot() { return slot_; }

  // Exactly once: the first of the reply and a cancellation wins.
  static void complete(const std::shared_ptr<AsioCall>& self, std::exception_ptr error,
                       Payload bytes) {
    if (self->done_.exchange(true)) return;
    if constexpr (std::is_void_v<R>) {
      post(self, [self, error]() mutable { std::move(self->handler_)(error); });
    } else {
      R value{};
      if (!error) {
        try {
          value = decode_value<R>(bytes);
        } catch (...) {
          error = std::current_exception();
        }
      }
      post(self, [self, error, v = std::move(value)]() mutable {
        std::move(self->handler_)(error, std::move(v));
      });
    }
  }

 private:
  template <class Fn>
  static void post(const std::shared_ptr<AsioCall>& self, Fn&& fn) {
    auto ex = self->work_.get_executor();
    asio::post(ex, [self, fn = std::forward<Fn>(fn)]() mutable {
      if (self->slot_.is_connected()) self->slot_.clear();  // on the handler's executor
      self->work_.reset();
      fn();
    });
  }

  Slot slot_;
  asio::executor_work_guard<Executor> work_;
  Handler handler_;
  std::atomic<bool> done_{false};
};

template <class R>
struct AsioCallInitiation {
  template <class Handler>
  void operator()(Handler&& handler, Context ctx, std::string name, Payload args) const {
    auto call = std::make_shared<AsioCall<R, std::decay_t<Handler>>>(std::forward<Handler>(handler));
    if (call->slot().is_connected()) {
      std::weak_ptr<AsioCall<R, std::decay_t<Handler>>> weak = call;
      call->slot().assign([weak](asio::cancellation_type) {
        if (auto c = weak.lock())
          AsioCall<R, std::decay_t<Handler>>::complete(
              c, std::make_exception_ptr(std::system_error(asio::error::operation_aborted)), {});
      });
    }
    try {
      ctx.start_call(name, std::move(args),
                     [call](std::exception_ptr e, Payload p) { AsioCall<R, std::decay_t<Handler>>::complete(call, e, std::move(p)); });
    } catch (...) {  // not sent (the runtime is gone): complete with why
      AsioCall<R, std::decay_t<Handler>>::complete(call, std::current_exception(), {});
    }
  }
};

template <class R>
struct AsioSignatureOf {
  using type = void(std::exception_ptr, R);
};
template <>
struct AsioSignatureOf<void> {
  using type = void(std::exception_ptr);
};
template <class R>
using AsioSignature = typename AsioSignatureOf<R>::type;

}  // namespace spindle::detail

template <class R, class... A, class... Rest>
auto spindle::Context::async_call(const method<R(A...)>& m, Rest&&... rest) const {
  static_assert(sizeof...(Rest) == sizeof...(A) + 1,
                "async_call(method, arguments..., completion token)");
  auto all = std::forward_as_tuple(std::forward<Rest>(rest)...);
  return [&]<std::size_t... I>(std::index_sequence<I...>) {
    Payload args = detail::encode_args<A...>(std::get<I>(all)...);
    return asio::async_initiate<std::tuple_element_t<sizeof...(A), std::tuple<Rest...>>,
                                detail::AsioSignature<R>>(
        detail::AsioCallInitiation<R>{}, std::get<sizeof...(A)>(all), *this,
        std::string(m.name()), std::move(args));
  }(std::index_sequence_for<A...>{});
}
