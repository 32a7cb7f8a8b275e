// <spindle/boost_asio.h>: typed calls with Boost.Asio completion tokens
// (opt-in): <spindle/asio.h> for programs built on Boost.Asio.
//
//   long r = co_await child.async_call(square, 9, boost::asio::use_awaitable);
//   child.async_call(square, 9, [](std::exception_ptr e, long r) { ... });
//   std::future<long> f = child.async_call(square, 9, boost::asio::use_future);
//   conn.async_find("upper-*", boost::asio::bind_executor(ioc, handler));
//
// The same members as <spindle/asio.h> (Context::async_call,
// Connection::async_find), with the same guarantees, from the same code
// (<spindle/asio_bridge.h>, instantiated here over Boost.Asio's names):
// one initiation (boost::asio::async_initiate) for every token; completion
// void(std::exception_ptr, R) exactly once, on the handler's associated
// executor, never on Spindle's broker thread; a work guard on that executor
// while the call is pending.
//  - Cancellation needs Boost.Asio's per-operation cancellation (Boost 1.77
//    and later): a bound cancellation slot completes the call at once with
//    boost::asio::error::operation_aborted, as a boost::system::system_error.
//    Boost 1.74 (Debian 12) has no cancellation slots: there a call ends
//    with its reply, an error or its deadline (Context::with_timeout).
//  - Lazy tokens work as they are: nothing is sent before the operation is
//    launched (boost::asio::deferred from Boost 1.80, or any token whose
//    async_result stores the initiation).
//  - Header-only Boost: nothing to link (no boost_system).
//
// One flavour per translation unit: including this and <spindle/asio.h> in
// one .cpp is an #error, since both define the same members. Different .cpp
// files of one program may use different flavours, as long as they do not
// both pass one callback type as the token (a function pointer or a
// std::function used with each flavour: wrap it in a lambda).
//
// Thread safety: as Context. Requires Boost headers (find_package(spindle
// COMPONENTS boost_asio) gives the spindle::boost_asio target).
#pragma once

#ifdef SPINDLE_ASIO_H_INCLUDED
#error "<spindle/boost_asio.h> and <spindle/asio.h> cannot both be included in one translation unit: \
they define the same async_call/async_find members; use one flavour per .cpp file"
#else  // the whole header: no cascade of Asio-vs-Boost errors after the #error
#define SPINDLE_BOOST_ASIO_H_INCLUDED 1

#include <exception>
#include <string_view>
#include <utility>

#include <boost/asio/associated_executor.hpp>
#include <boost/asio/async_result.hpp>
#include <boost/asio/error.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/version.hpp>
#include <boost/system/system_error.hpp>
#if BOOST_ASIO_VERSION >= 101900  // Boost 1.77: per-operation cancellation
#include <boost/asio/associated_cancellation_slot.hpp>
#define SPINDLE_BOOST_ASIO_HAS_CANCELLATION 1
#endif

#include <spindle/asio_bridge.h>
#include <spindle/connection.h>
#include <spindle/context.h>

namespace spindle::detail {

#ifndef SPINDLE_BOOST_ASIO_HAS_CANCELLATION
// Before Boost 1.77 no handler has a cancellation slot.
struct NoCancellationSlot {
  bool is_connected() const { return false; }
  template <class F>
  void assign(F&&) {}
  void clear() {}
};
#endif

// The pieces of Boost.Asio that asio_bridge.h is written against.
struct BoostAsio {
  template <class H>
  static auto executor(const H& h) { return boost::asio::get_associated_executor(h); }
  template <class Ex>
  static auto work_guard(const Ex& ex) { return boost::asio::make_work_guard(ex); }
  template <class Ex, class F>
  static void post(const Ex& ex, F&& f) { boost::asio::post(ex, std::forward<F>(f)); }
  template <class H>
  static auto cancellation_slot([[maybe_unused]] const H& h) {
#ifdef SPINDLE_BOOST_ASIO_HAS_CANCELLATION
    return boost::asio::get_associated_cancellation_slot(h);
#else
    return NoCancellationSlot{};
#endif
  }
  static std::exception_ptr aborted() {
    return std::make_exception_ptr(boost::system::system_error(boost::asio::error::operation_aborted));
  }
  template <class Token, class Sig, class Init, class... Args>
  static auto initiate(Init&& init, Token& token, Args&&... args) {
    return boost::asio::async_initiate<Token, Sig>(std::forward<Init>(init), token, std::forward<Args>(args)...);
  }
};

}  // namespace spindle::detail

template <class R, class... A, class... Rest>
auto spindle::Context::async_call(const method<R(A...)>& m, Rest&&... rest) const {
  return detail::async_call_with<detail::BoostAsio>(*this, m, std::forward<Rest>(rest)...);
}

template <class Token>
auto spindle::Connection::async_find(std::string_view pattern, Token&& token) const {
  return detail::async_find_with<detail::BoostAsio, Token>(*this, pattern, token);
}

template <class Token>
auto spindle::Runtime::async_shutdown(Token&& token) {
  return detail::async_shutdown_with<detail::BoostAsio, Token>(*this, token);
}

#endif
