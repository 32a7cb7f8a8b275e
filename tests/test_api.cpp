// The public API (<spindle/spindle.h>, <spindle/asio.h>) as a user meets it:
// typed calls to a forked child in every form, errors in every form, the
// access rule, where exposed functions run, Context and Child lifetimes, and
// the msgpack input check against hostile sizes.
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <future>
#include <map>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <asio/bind_cancellation_slot.hpp>
#include <asio/bind_executor.hpp>
#include <asio/cancellation_signal.hpp>
#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/experimental/deferred.hpp>
#include <asio/io_context.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/use_future.hpp>
#include <gtest/gtest.h>

#include <spindle/asio.h>
#include <spindle/spindle.h>

#include "services/client.h"
#include "tests/process_util.h"
#include "tests/router_test_util.h"

namespace test_api {

using namespace std::chrono_literals;

struct Point {
  int x = 0;
  std::string label;
  MSGPACK_DEFINE_MAP(x, label)
};

inline constexpr spindle::method<long(long)> square{"square"};
inline constexpr spindle::method<std::string(long)> square_as_text{"square"};  // a wrong declaration
inline constexpr spindle::method<Point(Point)> mirror{"geo.mirror"};
inline constexpr spindle::method<long()> tid{"tid"};
inline constexpr spindle::method<long()> count{"count"};
inline constexpr spindle::method<void(long)> nap{"nap"};
inline constexpr spindle::method<long(std::string)> fail{"fail"};
inline constexpr spindle::method<long(std::string, std::string)> fail_as{"fail_as"};
inline constexpr spindle::method<long(std::uint32_t)> ask_sibling{"ask_sibling"};
inline constexpr spindle::method<long(long)> open_square{"open.square"};
inline constexpr spindle::method<void(spindle::Sender<long>, long)> count_to{"count_to"};

int child_main(spindle::ChildEnv& env) {
  long calls = 0;
  env.expose(square, [](long n) { return n * n; });
  env.expose(mirror, [](Point p) { return Point{-p.x, p.label + "!"}; });
  env.expose(tid, [] { return static_cast<long>(::gettid()); });
  env.expose(count, [&calls] { return ++calls; });
  env.expose(nap, [](long ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); });
  env.expose(fail, [](std::string why) -> long { throw std::invalid_argument(why); });
  env.expose(fail_as, [](std::string type, std::string why) -> long {
    throw spindle::CallError(std::move(type), std::move(why));
  });
  env.expose(open_square, [](long n) { return n * n; }, spindle::Allow::kAnyone);
  env.expose(count_to, [](spindle::Sender<long> to, long n) {
    for (long i = 1; i <= n; ++i) to.send(i);
  });
  env.expose(ask_sibling, [&env](std::uint32_t sibling) {
    spindle::Context s(env.router(), sibling, "sibling");
    long open = s.call(open_square, 3L);
    try {
      s.call(square, 3L);
      return -1L;  // the parent-only function answered a sibling
    } catch (const spindle::ChannelError& e) {
      return std::string(e.what()).find("refused by service policy") != std::string::npos ? open : -2L;
    }
  });
  return env.serve();
}

class Api : public ::testing::Test {
 protected:
  spindle::Runtime rt;
  spindle::Child child = rt.fork_child(child_main, {.name = "api-child"});
};

TEST_F(Api, TypedCallBlockingFutureAndByName) {
  EXPECT_EQ(child.call(square, 7), 49);
  EXPECT_EQ(child.call_async(square, 3).get(), 9);
  EXPECT_EQ(child.call<long>("square", 5L), 25);
}

TEST_F(Api, StructsTravelAsMaps) {
  Point p = child.call(mirror, Point{4, "a"});
  EXPECT_EQ(p.x, -4);
  EXPECT_EQ(p.label, "a!");
  // What another language sees: a map with the field names as keys.
  spindle::Payload raw =
      child.call_named("geo.mirror", spindle::detail::encode_args<Point>(Point{1, "b"}));
  auto h = msgpack::unpack(raw.to_string().data(), raw.size());
  ASSERT_EQ(h.get().type, msgpack::type::MAP);
  auto m = h.get().as<std::map<std::string, msgpack::object>>();
  EXPECT_EQ(m.at("x").as<int>(), -1);
  EXPECT_EQ(m.at("label").as<std::string>(), "b!");
}

TEST_F(Api, RemoteExceptionArrivesAsCallErrorInEveryForm) {
  auto check = [](const spindle::CallError& e) {
    EXPECT_EQ(e.type(), "std::invalid_argument");
    EXPECT_EQ(e.message(), "no such thing");
  };
  try {
    child.call(fail, "no such thing");
    ADD_FAILURE() << "no CallError";
  } catch (const spindle::CallError& e) {
    check(e);
  }
  auto f = child.call_async(fail, "no such thing");
  EXPECT_THROW(f.get(), spindle::CallError);
  // A plain callback runs on Asio's system executor: hand its result over.
  std::promise<std::exception_ptr> done;
  child.async_call(fail, "no such thing", [&](std::exception_ptr e, long) { done.set_value(e); });
  auto seen = done.get_future();
  ASSERT_EQ(seen.wait_for(5s), std::future_status::ready);
  try {
    std::rethrow_exception(seen.get());
  } catch (const spindle::CallError& e) {
    check(e);
  }
}

TEST_F(Api, AFunctionThatThrowsCallErrorAnswersWithItsTypeAndMessage) {
  try {
    child.call(fail_as, "mypkg.NotFound", "no such key");
    ADD_FAILURE() << "no CallError";
  } catch (const spindle::CallError& e) {
    EXPECT_EQ(e.type(), "mypkg.NotFound");
    EXPECT_EQ(e.message(), "no such key");
  }
}

TEST_F(Api, BytesThatDoNotDecodeAreADecodeError) {
  // Arguments the callee cannot decode: a string for a long.
  try {
    child.call<long>("square", std::string("seven"));
    ADD_FAILURE() << "no CallError";
  } catch (const spindle::CallError& e) {
    EXPECT_EQ(e.type(), spindle::kDecodeErrorType) << e.what();
  }
  // A result the caller cannot decode: the caller declared the wrong type.
  try {
    child.call(square_as_text, 2);
    ADD_FAILURE() << "no CallError";
  } catch (const spindle::CallError& e) {
    EXPECT_EQ(e.type(), spindle::kDecodeErrorType) << e.what();
  }
}

TEST_F(Api, UnknownNamesAndRawCallsGetAClearDeadReply) {
  try {
    child.call<long>("nothing_here", 1L);
    ADD_FAILURE() << "no ChannelError";
  } catch (const spindle::ChannelError& e) {
    EXPECT_NE(std::string(e.what()).find("unknown method: fn.nothing_here"), std::string::npos) << e.what();
  }
  // A caller that sends raw bytes to a typed function (an older peer, or a
  // mistake) is told so, rather than having its bytes misread.
  try {
    spindle::services::call(child, "fn", "square", spindle::Payload::copy_of("7"));
    ADD_FAILURE() << "no ChannelError";
  } catch (const spindle::ChannelError& e) {
    EXPECT_NE(std::string(e.what()).find("wrong argument encoding"), std::string::npos) << e.what();
  }
  EXPECT_EQ(child.call(square, 2), 4);  // the child is unharmed
}

TEST_F(Api, ExposedFunctionsRunOnTheThreadThatServes) {
  // serve() runs on the forked child's only thread at first: main's, whose
  // kernel id is the process id.
  EXPECT_EQ(child.call(tid), child.pid());
}

TEST_F(Api, OnlyTheParentMayCallByDefault) {
  spindle::Child sibling = rt.fork_child(child_main, {.name = "sibling"});
  // 9 means: the open function answered the sibling, the default one refused it.
  EXPECT_EQ(child.call(ask_sibling, sibling.id()), 9);
}

TEST_F(Api, ContextUsedAfterItsRuntimeIsGoneThrowsShutdownError) {
  spindle::Context kept;
  {
    spindle::Runtime other;
    spindle::Child c = other.fork_child(child_main);
    kept = c;
    EXPECT_EQ(kept.call(square, 4), 16);
  }
  EXPECT_THROW(kept.call(square, 4), spindle::ShutdownError);
  EXPECT_THROW(kept.call_async(square, 4), spindle::ShutdownError);
  EXPECT_THROW(kept.send(3000, std::string_view("x")), spindle::ShutdownError);
  std::promise<std::exception_ptr> done;
  kept.async_call(square, 4, [&](std::exception_ptr e, long) { done.set_value(e); });
  auto seen = done.get_future();
  ASSERT_EQ(seen.wait_for(5s), std::future_status::ready);
  EXPECT_THROW(std::rethrow_exception(seen.get()), spindle::ShutdownError);
}

TEST_F(Api, ASenderTravelsAsAnArgumentAndItsReceiverGetsValuesInOrder) {
  spindle::Receiver<long> rx(rt);
  child.call(count_to, rx.sender(), 5L);
  for (long i = 1; i <= 5; ++i) EXPECT_EQ(rx.receive(), i);
  EXPECT_EQ(rx.receive_for(20ms), std::nullopt);
  // Two receivers never mix: each has its own handle.
  spindle::Receiver<long> other(rt);
  child.call_async(count_to, other.sender(), 2L).get();
  EXPECT_EQ(other.receive(), 1);
  EXPECT_EQ(rx.receive_for(20ms), std::nullopt);
}

// A Sender names where its callee will send, in the callee's own name: one
// that names a control handle (here the callee's own SHUTDOWN) or a call's
// reply handle is refused as it is decoded, and the callee sends nothing.
TEST_F(Api, AReceivedSenderNamingAControlOrReplyHandleIsADecodeError) {
  for (std::uint32_t handle : {std::uint32_t{spindle::kHandleShutdown}, std::uint32_t{spindle::kHandleCallService},
                               0x80000001u}) {
    spindle::Sender<long> forged(rt.context(child.id()), handle);
    try {
      child.call(count_to, forged, 1L);
      ADD_FAILURE() << "handle " << handle << " was taken";
    } catch (const spindle::CallError& e) {
      EXPECT_EQ(e.type(), spindle::kDecodeErrorType) << e.what();
      EXPECT_NE(std::string(e.what()).find("no Receiver holds"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(child.call(square, 3L), 9);  // still there: it did not shut itself down
}

TEST(ApiChannel, AReceiverWhoseRuntimeIsGoneThrowsShutdownError) {
  std::unique_ptr<spindle::Receiver<long>> rx;
  std::thread waiter;
  std::exception_ptr seen;
  {
    spindle::Runtime rt;
    rx = std::make_unique<spindle::Receiver<long>>(rt);
    rx->sender().send(7);
    EXPECT_EQ(rx->receive(), 7);
    waiter = std::thread([&] {
      try {
        rx->receive();
      } catch (...) {
        seen = std::current_exception();
      }
    });
    std::this_thread::sleep_for(20ms);
  }  // the runtime goes while the waiter waits
  waiter.join();
  ASSERT_TRUE(seen);
  EXPECT_THROW(std::rethrow_exception(seen), spindle::ShutdownError);
  EXPECT_THROW(rx->receive(), spindle::ShutdownError);
  rx.reset();  // gives its handle back to a router that is gone: no crash
}

TEST(ApiChild, StopEndsAServingChildGracefully) {
  spindle::Runtime rt;
  spindle::Child c = rt.fork_child(child_main);
  pid_t pid = c.pid();
  int st = c.stop();
  ASSERT_TRUE(WIFEXITED(st)) << st;
  EXPECT_EQ(WEXITSTATUS(st), 0);
  EXPECT_EQ(c.stop(), st);  // idempotent
  EXPECT_EQ(::kill(pid, 0), -1);  // reaped: no such process (nor zombie)
}

// A worker that died (kill -9) before its program closes is stopped without a
// SHUTDOWN: it has no link left, and the message was dropped with a warning
// about an undeliverable message at every such close.
TEST(ApiChild, StoppingAChildThatDiedSendsNothingAndWarnsOfNothing) {
  spindle::testutil::ScopedLogCapture capture;
  spindle::Runtime rt;
  spindle::Child other = rt.fork_child(child_main, {.name = "other"});
  spindle::Child c = rt.fork_child(child_main, {.name = "doomed"});
  ASSERT_EQ(c.call(square, 3), 9);
  ASSERT_EQ(::kill(c.pid(), SIGKILL), 0);
  // Once a call fails, the router has seen the link go and dropped its route.
  auto deadline = std::chrono::steady_clock::now() + 20s;
  bool gone = false;
  while (!gone && std::chrono::steady_clock::now() < deadline) {
    try {
      c.call(square, 3);
      std::this_thread::sleep_for(5ms);
    } catch (const spindle::Error&) {
      gone = true;
    }
  }
  ASSERT_TRUE(gone);
  int st = c.stop();
  ASSERT_TRUE(WIFSIGNALED(st)) << st;
  EXPECT_EQ(WTERMSIG(st), SIGKILL);
  EXPECT_EQ(other.call(square, 4), 16);  // the broker has run past anything stop() sent
  EXPECT_EQ(capture.sink().lines_with("undeliverable"), std::vector<std::string>{});
}

// A child killed while a process it forked holds its end of the link (a
// multiprocessing worker, a daemon it started) sends no EOF: the copy keeps
// the socket open. Its parent learns of the death from the child's pidfd
// and fails the pending calls at once, naming how it ended; before, they
// waited for their timeout, and the child's route stayed.
TEST(ApiChild, AKilledChildWhoseForkHoldsItsLinkFailsItsCallsAtOnce) {
  spindle::Runtime rt;
  static constexpr spindle::method<long()> holder_pid{"holder_pid"};
  spindle::Child c = rt.fork_child([](spindle::ChildEnv& env) {
    const pid_t holder = ::fork();  // keeps a copy of every fd, the link's too
    if (holder == 0) {
      ::alarm(60);
      for (;;) ::pause();
    }
    env.expose(holder_pid, [holder] { return static_cast<long>(holder); });
    env.expose(nap, [](long ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); });
    return env.serve();
  });
  const long holder = c.call(holder_pid);
  ASSERT_GT(holder, 0);
  std::future<void> pending = c.with_timeout(60s).call_async(nap, 30000L);
  ASSERT_EQ(pending.wait_for(100ms), std::future_status::timeout);
  ASSERT_EQ(::kill(c.pid(), SIGKILL), 0);
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_EQ(pending.wait_for(10s), std::future_status::ready) << "the call still waits for the dead child";
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  try {
    pending.get();
    ADD_FAILURE() << "the call to a killed child returned";
  } catch (const spindle::Error& e) {
    EXPECT_NE(std::string(e.what()).find("killed by signal 9"), std::string::npos) << e.what();
  }
  EXPECT_THROW(c.call(square, 2L), spindle::Error);  // its route is gone
  ::kill(static_cast<pid_t>(holder), SIGKILL);
}

// The other way round: a parent killed with -9 while a process it forked
// holds its end of a child's link. The child learns of it from its parent's
// pidfd and ends; before, it served on for as long as that fork lived.
TEST(ApiChild, AChildOutlivesNoParentWhoseForkHoldsItsLink) {
  spindle::testutil::TempDir dir;
  const std::string out = dir.path() + "/pids";
  pid_t parent = ::fork();
  ASSERT_GE(parent, 0);
  if (parent == 0) {
    ::execl(SPINDLE_HELPER_DIR "/forked_parent", "forked_parent", out.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  int child = 0, holder = 0;
  auto deadline = std::chrono::steady_clock::now() + 20s;
  while (std::chrono::steady_clock::now() < deadline) {
    if (std::FILE* f = std::fopen(out.c_str(), "re")) {
      const int got = std::fscanf(f, "%d %d", &child, &holder);
      std::fclose(f);
      if (got == 2) break;
    }
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_GT(child, 0);
  ASSERT_GT(holder, 0);
  const int child_fd = static_cast<int>(::syscall(SYS_pidfd_open, child, 0));
  ASSERT_GE(child_fd, 0);
  ASSERT_EQ(::kill(parent, SIGKILL), 0);
  ASSERT_EQ(::waitpid(parent, nullptr, 0), parent);
  pollfd p{child_fd, POLLIN, 0};
  EXPECT_EQ(::poll(&p, 1, 10000), 1) << "the child still runs with its parent gone";
  ::kill(child, SIGKILL);
  ::kill(holder, SIGKILL);
  ::close(child_fd);
}

TEST(ApiChild, DestructorKillsAChildThatIgnoresShutdown) {
  spindle::Runtime rt;
  pid_t pid;
  auto t0 = std::chrono::steady_clock::now();
  {
    spindle::Child c = rt.fork_child(
        [](spindle::ChildEnv&) {
          ::signal(SIGTERM, SIG_IGN);
          for (;;) ::pause();
          return 0;
        },
        {.name = "stubborn", .grace = 300ms});
    pid = c.pid();
  }
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 300ms);
  EXPECT_EQ(::kill(pid, 0), -1);
  EXPECT_EQ(errno, ESRCH);
}

TEST(ApiChild, MovedChildOwnsTheProcessOnce) {
  spindle::Runtime rt;
  spindle::Child a = rt.fork_child(child_main);
  spindle::Child b = std::move(a);
  EXPECT_EQ(b.call(square, 6), 36);
  EXPECT_EQ(a.stop(), -1);  // owns nothing now
  EXPECT_THROW(a.call(square, 1), spindle::ShutdownError);
  EXPECT_TRUE(WIFEXITED(b.stop()));
}

TEST_F(Api, CompletionTokens) {
  asio::io_context ioc{1};
  long awaited = 0;
  asio::co_spawn(
      ioc, [&]() -> asio::awaitable<void> { awaited = co_await child.async_call(square, 9, asio::use_awaitable); },
      asio::detached);
  ioc.run();  // the pending call's work guard keeps run() going until it completes
  EXPECT_EQ(awaited, 81);

  std::future<long> f = child.async_call(square, 8, asio::use_future);
  EXPECT_EQ(f.get(), 64);

  // A completion runs on the handler's executor: this io_context's thread.
  ioc.restart();
  std::thread::id ran_on;
  long got = 0;
  child.async_call(square, 5, asio::bind_executor(ioc, [&](std::exception_ptr e, long r) {
                     EXPECT_FALSE(e);
                     got = r;
                     ran_on = std::this_thread::get_id();
                   }));
  ioc.run();
  EXPECT_EQ(got, 25);
  EXPECT_EQ(ran_on, std::this_thread::get_id());
}

TEST_F(Api, DeferredSendsNothingBeforeItIsAwaited) {
  auto op = child.async_call(count, asio::experimental::deferred);
  EXPECT_EQ(child.call(count), 1);  // the deferred call has not run
  std::promise<long> later;
  std::move(op)([&](std::exception_ptr e, long n) {
    if (e) later.set_exception(e);
    else later.set_value(n);
  });
  auto f = later.get_future();
  ASSERT_EQ(f.wait_for(5s), std::future_status::ready);
  EXPECT_EQ(f.get(), 2);
}

TEST_F(Api, CancellationCompletesWithOperationAborted) {
  asio::io_context ioc{1};
  asio::cancellation_signal cancel;
  std::exception_ptr seen;
  bool done = false;
  auto t0 = std::chrono::steady_clock::now();
  child.async_call(nap, 1500L,
                   asio::bind_cancellation_slot(cancel.slot(), asio::bind_executor(ioc, [&](std::exception_ptr e) {
                                                  seen = e;
                                                  done = true;
                                                })));
  asio::post(ioc, [&] { cancel.emit(asio::cancellation_type::terminal); });
  ioc.run();
  ASSERT_TRUE(done);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1000ms);
  try {
    std::rethrow_exception(seen);
  } catch (const std::system_error& e) {
    EXPECT_EQ(e.code(), asio::error::operation_aborted);
  }
}

TEST(ApiCodec, AHostileContainerSizeIsRefusedBeforeAnythingIsAllocated) {
  // array32 claiming 4 billion elements, in 5 bytes; then a map32 the same.
  for (std::string bytes : {std::string("\xdd\xff\xff\xff\xff", 5), std::string("\xdf\x7f\xff\xff\xff", 5),
                            std::string("\x92\x01", 2), std::string("\xc1", 1), std::string("\x01\x02", 2)}) {
    EXPECT_THROW(spindle::detail::unpack_checked(spindle::Payload::copy_of(bytes), "arguments"),
                 spindle::DecodeError);
  }
  auto ok = spindle::detail::encode_args<long, std::string, std::vector<int>>(1L, "x", std::vector<int>{1, 2, 3});
  EXPECT_NO_THROW(spindle::detail::unpack_checked(ok, "arguments"));
  // The check alone, as the Python binding uses it before unpacking by reference.
  EXPECT_EQ(spindle::detail::msgpack_shape_problem(ok.contiguous()), "");
  const std::string hostile("\xdd\xff\xff\xff\xff", 5);
  EXPECT_NE(spindle::detail::msgpack_shape_problem(
                {reinterpret_cast<const std::uint8_t*>(hostile.data()), hostile.size()}),
            "");
}

// A body this process holds (a large result kept as a Payload) is charged to
// the child's link, which stops reading from the child until it is released.
// The child is not at fault: past the stall timeout it is still connected,
// and its next reply arrives once the body goes. Before, it was dropped
// ("stayed over its memory limit ... without reading") after 10 s.
TEST(ApiMemory, AChildIsNotDroppedWhileThisProcessHoldsItsLargeResult) {
  static constexpr spindle::method<std::vector<std::uint8_t>(long)> blob{"blob"};
  spindle::RouterOptions o;
  o.peer_memory_limit = 4u << 20;
  o.stall_timeout = 200ms;
  spindle::Runtime rt(o);
  spindle::Child c = rt.fork_child(
      [](spindle::ChildEnv& env) {
        env.expose(blob, [](long n) { return std::vector<std::uint8_t>(static_cast<std::size_t>(n), 7); });
        env.expose(square, [](long n) { return n * n; });
        return env.serve();
      },
      {.name = "holder"});
  spindle::Payload held = c.call_named("blob", spindle::detail::encode_args<long>(8L << 20));
  ASSERT_GT(held.size(), 8u << 20);
  std::future<long> next = c.async_call(square, 9L, asio::use_future);
  // Five stall timeouts: the reply waits in the paused link, and nothing
  // drops the child (which would fail the call at once).
  EXPECT_EQ(next.wait_for(1s), std::future_status::timeout) << "the child's link was not paused";
  held = spindle::Payload();
  EXPECT_EQ(next.get(), 81);
}

// A padded value (ext 83, a Python spindle.Buffer sent as a whole message)
// decodes as the value after its pad; a pad running past the end is refused.
TEST(ApiCodec, APaddedValueDecodesAsTheValueAfterItsPad) {
  // ext 8, length 7, type 83: pad_len 3, three pad bytes, then bin 8 "xy".
  const std::string padded("\xc7\x09\x53\x00\x03\x00\x00\x00\xc4\x02xy", 12);
  auto bytes = spindle::detail::decode_value<std::vector<std::uint8_t>>(spindle::Payload::copy_of(padded));
  EXPECT_EQ(bytes, (std::vector<std::uint8_t>{'x', 'y'}));
  // The same with a pad that claims 9 bytes: a DecodeError, reported as the
  // result's CallError (kDecodeErrorType), never a read past the end.
  std::string bad = padded;
  bad[4] = '\x09';
  EXPECT_THROW(spindle::detail::decode_value<std::vector<std::uint8_t>>(spindle::Payload::copy_of(bad)),
               spindle::CallError);
  // Another ext type is left alone (here: refused as the wrong type).
  std::string other = padded;
  other[2] = '\x54';
  EXPECT_THROW(spindle::detail::decode_value<std::vector<std::uint8_t>>(spindle::Payload::copy_of(other)),
               spindle::CallError);
}

// Tuples, pairs and std::arrays of the wrong length are a DecodeError at any
// depth. msgpack-c++ 4.1 alone reads a short array decoded as a tuple with a
// std::wstring element from before its start: [[1]] as
// (tuple<long, wstring>) read out of bounds. Without such an element it left
// the missing values default, silently.
TEST(ApiCodec, ATupleOrArrayOfTheWrongLengthIsADecodeErrorAtAnyDepth) {
  using Wide = std::tuple<long, std::wstring>;
  auto raw = [](std::string b) { return spindle::Payload::copy_of(b); };
  const std::string one_in_one("\x91\x91\x01", 3);  // [[1]]
  auto expect_length_error = [](auto&& decode) {
    try {
      decode();
      ADD_FAILURE() << "decoded";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("expected an array of"), std::string::npos) << e.what();
    }
  };
  expect_length_error([&] { spindle::detail::decode_args<Wide>(raw(one_in_one)); });
  expect_length_error([&] { spindle::detail::decode_args<std::tuple<long, long>>(raw(one_in_one)); });
  expect_length_error([&] { spindle::detail::decode_args<std::array<std::wstring, 2>>(raw(one_in_one)); });
  // Nested: [[[1]]] as a vector of them, {1: [1]} as a map to them, and an
  // optional one; a result too.
  expect_length_error(
      [&] { spindle::detail::decode_args<std::vector<Wide>>(raw(std::string("\x91\x91\x91\x01", 4))); });
  expect_length_error([&] {
    spindle::detail::decode_args<std::map<long, std::optional<Wide>>>(raw(std::string("\x91\x81\x01\x91\x01", 5)));
  });
  expect_length_error([&] { spindle::detail::decode_value<std::pair<long, Wide>>(raw(std::string("\x92\x01\x91\x01", 4))); });
  // Too long is refused as well; the right length decodes.
  expect_length_error([&] { spindle::detail::decode_args<std::tuple<long>>(raw(std::string("\x91\x92\x01\x02", 4))); });
  auto ok = spindle::detail::encode_args<std::vector<Wide>>(std::vector<Wide>{{1, L"a"}, {2, L"bc"}});
  auto [back] = spindle::detail::decode_args<std::vector<Wide>>(ok);
  EXPECT_EQ(back, (std::vector<Wide>{{1, L"a"}, {2, L"bc"}}));
}

}  // namespace test_api
