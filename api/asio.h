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
// Connection::async_find(pattern, token) works the same way, with the
// signature void(std::exception_ptr, std::vector<spindle::Context>), and so
// does Runtime::async_shutdown(token), void(std::exception_ptr). Hosted mode
// (spindle::hosted_runtime) is in <spindle/hosted.h>, included here.
//
// One flavour per translation unit: this header and <spindle/boost_asio.h>
// define the same members (Context::async_call, Connection::async_find), so
// including both in one .cpp is an #error. Different .cpp files of one
// program may use different flavours; the one thing they must not share is
// a callback type passed as the token in both (a plain function pointer or
// std::function used as a callback with each flavour would name one
// function with two definitions): wrap such a callback in a lambda.
// The implementation, shared with Boost.Asio, is <spindle/asio_bridge.h>.
//
// Thread safety: as Context. Requires standalone Asio (find_package(spindle
// COMPONENTS asio) gives the spindle::asio target).
#pragma once

#ifdef SPINDLE_BOOST_ASIO_H_INCLUDED
#error "<spindle/asio.h> and <spindle/boost_asio.h> cannot both be included in one translation unit: \
they define the same async_call/async_find members; use one flavour per .cpp file"
#else  // the whole header: no cascade of Asio-vs-Boost errors after the #error
#define SPINDLE_ASIO_H_INCLUDED 1

#include <exception>
#include <string_view>
#include <system_error>
#include <utility>

#include <asio/associated_cancellation_slot.hpp>
#include <asio/associated_executor.hpp>
#include <asio/async_result.hpp>
#include <asio/error.hpp>
#include <asio/executor_work_guard.hpp>
#include <asio/post.hpp>

#include <spindle/asio_bridge.h>
#include <spindle/connection.h>
#include <spindle/context.h>
#include <spindle/hosted.h>

namespace spindle::detail {

// The pieces of standalone Asio that asio_bridge.h is written against.
struct StandaloneAsio {
  template <class H>
  static auto executor(const H& h) { return asio::get_associated_executor(h); }
  template <class Ex>
  static auto work_guard(const Ex& ex) { return asio::make_work_guard(ex); }
  template <class Ex, class F>
  static void post(const Ex& ex, F&& f) { asio::post(ex, std::forward<F>(f)); }
  template <class H>
  static auto cancellation_slot(const H& h) { return asio::get_associated_cancellation_slot(h); }
  static std::exception_ptr aborted() {
    return std::make_exception_ptr(std::system_error(asio::error::operation_aborted));
  }
  template <class Token, class Sig, class Init, class... Args>
  static auto initiate(Init&& init, Token& token, Args&&... args) {
    return asio::async_initiate<Token, Sig>(std::forward<Init>(init), token, std::forward<Args>(args)...);
  }
};

}  // namespace spindle::detail

template <class R, class... A, class... Rest>
auto spindle::Context::async_call(const method<R(A...)>& m, Rest&&... rest) const {
  return detail::async_call_with<detail::StandaloneAsio>(*this, m, std::forward<Rest>(rest)...);
}

template <class Token>
auto spindle::Connection::async_find(std::string_view pattern, Token&& token) const {
  return detail::async_find_with<detail::StandaloneAsio, Token>(*this, pattern, token);
}

template <class Token>
auto spindle::Runtime::async_shutdown(Token&& token) {
  return detail::async_shutdown_with<detail::StandaloneAsio, Token>(*this, token);
}

#endif
