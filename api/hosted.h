// <spindle/hosted.h>: Spindle on the application's own asio::io_context
// (opt-in; <spindle/asio.h> includes it, and defines Runtime::async_shutdown).
//
//   asio::io_context ioc;
//   spindle::Runtime rt = spindle::hosted_runtime(ioc);  // no thread of its own
//   spindle::Child child = rt.fork_child(child_main);
//   asio::co_spawn(ioc, [&]() -> asio::awaitable<void> {
//     long r = co_await child.async_call(square, 7, asio::use_awaitable);
//     co_await rt.async_shutdown(asio::use_awaitable);
//   }, asio::detached);
//   ioc.run();   // returns once the runtime has shut down and nothing else waits
//
// The rules of a hosted runtime, which are the broker thread's rules:
//  - Its loop thread is the thread that calls hosted_runtime(), and it must
//    be the one that runs `ioc`. A handler of Spindle's that another thread
//    runs throws spindle::Error out of that thread's run() ("run by a second
//    thread"): the single-thread rule that makes the broker lock-free.
//  - Nothing blocks on the loop thread: a blocking call there (call(),
//    call<R>(name), ...) throws spindle::Error; use call_async's future from
//    another thread, or async_call with a completion token.
//  - The loop thread blocks SIGPIPE, as Spindle's own broker thread does (a
//    write to a closed pipe is then an EPIPE, not the end of the process).
//  - Shut down with async_shutdown(token): queued messages are flushed and
//    children told, within the grace period; then it completes, and `ioc`
//    has no more work of Spindle's. Destroyed without it, on the loop
//    thread, the runtime stops at once (streams closed, pending calls
//    failed with "shutting down"); destroyed on another thread, it waits
//    for the loop to finish it, so the loop must be running then.
//  - `ioc` must outlive the runtime, and both must be compiled against the
//    same Asio (checked: a mismatch throws Error).
//
// Thread safety: as Runtime; Contexts of a hosted runtime may be used from
// any thread (what they send is handed to the loop thread).
// Ownership: the runtime borrows `ioc`.
#pragma once

#include <utility>

#include <asio/io_context.hpp>
#include <asio/version.hpp>

#include <spindle/runtime.h>

namespace spindle {

// A Runtime whose loop is `ioc`, run by the calling thread.
inline Runtime hosted_runtime(asio::io_context& ioc, RouterOptions opts = {}) {
  return Runtime(detail::HostedLoop{&ioc, ASIO_VERSION, sizeof(asio::io_context)}, std::move(opts));
}

}  // namespace spindle
