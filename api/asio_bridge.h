// <spindle/asio_bridge.h>: the one implementation of completion tokens
// behind <spindle/asio.h> and <spindle/boost_asio.h>. Include one of those,
// not this.
//
// Role: turns the library's Asio-free initiation seams (Context::start_call,
// Connection::start_find, Runtime::start_shutdown) into asynchronous operations of an Asio flavour.
// Everything here is a template over `Net`, a small traits struct that the
// flavour's header defines to name its namespace's pieces:
//
//   struct Net {
//     template <class H> static auto executor(const H&);        // associated executor
//     template <class Ex> static auto work_guard(const Ex&);    // keeps Ex's loop alive
//     template <class Ex, class F> static void post(const Ex&, F&&);
//     template <class H> static auto cancellation_slot(const H&);  // is_connected/assign/clear
//     static std::exception_ptr aborted();                      // operation_aborted
//     template <class Token, class Sig, class Init, class... Args>
//     static auto initiate(Init&&, Token&, Args&&...);          // async_initiate
//   };
//
// So this header names no Asio type and compiles on its own. What it
// guarantees, for every flavour and token:
//  - exactly one completion: the first of the reply (or error) and a
//    cancellation wins, the other is dropped;
//  - the completion runs on the handler's associated executor (posted, never
//    on the broker thread), and a work guard on that executor is held from
//    the start until the completion has run, and by the completing thread
//    until its post() has returned (so run() cannot return, and the loop be
//    destroyed, under a post still in progress);
//  - a cancellation (the handler's slot, when connected) completes at once
//    with Net::aborted(); the request already sent still runs remotely and
//    its reply is dropped;
//  - results are decoded on the broker thread, where the runtime is known
//    alive (Senders among them need it), before being posted.
//
// Thread safety: as Context. Ownership: an operation owns its handler until
// it completes; the cancellation slot refers to it weakly.
#pragma once

#include <atomic>
#include <cstddef>
#include <exception>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <spindle/codec.h>
#include <spindle/connection.h>
#include <spindle/context.h>
#include <spindle/runtime.h>

namespace spindle::detail {

// What a completion passes after the exception_ptr: nothing for void.
struct NoValue {};
template <class T>
using ValueOrNone = std::conditional_t<std::is_void_v<T>, NoValue, T>;

template <class T>
struct NetSignatureOf {
  using type = void(std::exception_ptr, T);
};
template <>
struct NetSignatureOf<void> {
  using type = void(std::exception_ptr);
};
template <class T>
using NetSignature = typename NetSignatureOf<T>::type;

// One pending operation with its handler; shared by the seam's completion
// and (weakly) by the cancellation slot.
template <class Net, class T, class Handler>
class NetOp {
 public:
  using Value = ValueOrNone<T>;

  // Makes the operation and connects the handler's cancellation slot.
  static std::shared_ptr<NetOp> start(Handler&& h) {
    auto op = std::shared_ptr<NetOp>(new NetOp(std::move(h)));
    if (op->slot_.is_connected()) {
      std::weak_ptr<NetOp> weak = op;
      op->slot_.assign([weak](auto /*cancellation type*/) {
        if (auto o = weak.lock()) complete(o, Net::aborted());
      });
    }
    return op;
  }

  // Exactly once: the first caller wins.
  static void complete(const std::shared_ptr<NetOp>& self, std::exception_ptr error, Value value = {}) {
    if (self->done_.exchange(true)) return;
    auto ex = self->work_.get_executor();
    // Work of this thread's own until post() has returned: the handler may
    // run (and drop work_) before post() is done signalling the loop, and
    // the loop's run() must not return, letting its owner destroy it, while
    // this thread is still inside post().
    auto posting = Net::work_guard(ex);
    Net::post(ex, [self, error, v = std::move(value)]() mutable {
      if (self->slot_.is_connected()) self->slot_.clear();  // on the handler's executor
      self->work_.reset();
      if constexpr (std::is_void_v<T>) std::move(self->handler_)(error);
      else std::move(self->handler_)(error, std::move(v));
    });
  }

 private:
  explicit NetOp(Handler&& h)
      : slot_(Net::cancellation_slot(h)), work_(Net::work_guard(Net::executor(h))), handler_(std::move(h)) {}

  decltype(Net::cancellation_slot(std::declval<const Handler&>())) slot_;
  decltype(Net::work_guard(Net::executor(std::declval<const Handler&>()))) work_;
  Handler handler_;
  std::atomic<bool> done_{false};
};

// A typed call: R decoded from the reply's bytes.
template <class Net, class R>
struct CallInitiation {
  template <class Handler>
  void operator()(Handler&& handler, Context ctx, std::string name, Payload args) const {
    using Op = NetOp<Net, R, std::decay_t<Handler>>;
    auto op = Op::start(std::forward<Handler>(handler));
    try {
      Router* r = &ctx.router();  // alive while the completion can run
      ctx.start_call(name, std::move(args), [op, r](std::exception_ptr error, Payload bytes) {
        ValueOrNone<R> value{};
        if constexpr (!std::is_void_v<R>) {
          if (!error) {
            try {
              DecodingScope scope(*r);
              value = decode_value<R>(bytes);
            } catch (...) {
              error = std::current_exception();
            }
          }
        }
        Op::complete(op, error, std::move(value));
      });
    } catch (...) {  // not sent (the runtime is gone): complete with why
      Op::complete(op, std::current_exception());
    }
  }
};

// Connection::async_find: start_find never throws, it completes.
template <class Net>
struct FindInitiation {
  template <class Handler>
  void operator()(Handler&& handler, const Connection* conn, std::string pattern) const {
    using Op = NetOp<Net, std::vector<Context>, std::decay_t<Handler>>;
    auto op = Op::start(std::forward<Handler>(handler));
    conn->start_find(pattern, [op](std::exception_ptr error, std::vector<Context> found) {
      Op::complete(op, error, std::move(found));
    });
  }
};

// Context::async_call(method, args..., token): the last argument is the token.
template <class Net, class R, class... A, class... Rest>
auto async_call_with(const Context& ctx, const method<R(A...)>& m, Rest&&... rest) {
  static_assert(sizeof...(Rest) == sizeof...(A) + 1,
                "async_call(method, arguments..., completion token)");
  auto all = std::forward_as_tuple(std::forward<Rest>(rest)...);
  using Token = std::tuple_element_t<sizeof...(A), std::tuple<Rest...>>;
  return [&]<std::size_t... I>(std::index_sequence<I...>) {
    Payload args = encode_args<A...>(std::forward<std::tuple_element_t<I, std::tuple<Rest...>>>(std::get<I>(all))...);
    return Net::template initiate<Token, NetSignature<R>>(CallInitiation<Net, R>{}, std::get<sizeof...(A)>(all),
                                                          ctx, std::string(m.name()), std::move(args));
  }(std::index_sequence_for<A...>{});
}

// Runtime::async_shutdown: completes once the broker has finished.
template <class Net>
struct ShutdownInitiation {
  template <class Handler>
  void operator()(Handler&& handler, Runtime* rt) const {
    using Op = NetOp<Net, void, std::decay_t<Handler>>;
    auto op = Op::start(std::forward<Handler>(handler));
    try {
      rt->start_shutdown([op] { Op::complete(op, nullptr); });
    } catch (...) {
      Op::complete(op, std::current_exception());
    }
  }
};

template <class Net, class Token>
auto async_shutdown_with(Runtime& rt, Token& token) {
  return Net::template initiate<Token, NetSignature<void>>(ShutdownInitiation<Net>{}, token, &rt);
}

template <class Net, class Token>
auto async_find_with(const Connection& conn, std::string_view pattern, Token& token) {
  return Net::template initiate<Token, NetSignature<std::vector<Context>>>(FindInitiation<Net>{}, token, &conn,
                                                                           std::string(pattern));
}

}  // namespace spindle::detail
