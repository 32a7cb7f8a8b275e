// Fd arguments in the public API (<spindle/codec.h>: a spindle::UniqueFd
// parameter) and the public slot buffer (<spindle/slots.h>) they carry:
// fds arrive, each is owned exactly once (given up, duplicated, closed with
// the message), and a transport that cannot carry fds refuses the call with
// a named reason instead of dropping them.
//
// A pipe proves who holds an fd: its read end sees EOF only once every copy
// of the write end is closed, in every process.
#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <future>
#include <string>
#include <utility>

#include <asio/use_future.hpp>
#include <gtest/gtest.h>

#include <spindle/asio.h>
#include <spindle/spindle.h>
#include "tests/fds_test_util.h"

namespace test_api_fds {

using namespace std::chrono_literals;

using spindle::testutil::Pipe;
constexpr auto make_pipe = spindle::testutil::make_owned_pipe;

// What the read end yields until EOF, or "<timeout>" after 10 s without it.
std::string read_to_eof(const spindle::UniqueFd& fd) {
  std::string out;
  char buf[256];
  for (;;) {
    pollfd p{fd.get(), POLLIN, 0};
    if (::poll(&p, 1, 10'000) != 1) return out + "<timeout>";
    ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n <= 0) return out;
    out.append(buf, static_cast<std::size_t>(n));
  }
}

long open_fd_count() {
  long n = 0;
  for ([[maybe_unused]] auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

struct Record {
  static constexpr std::uint32_t kLayoutId = 7;
  std::uint64_t a;
  double b;
};
struct OtherRecord {
  static constexpr std::uint32_t kLayoutId = 8;
  std::uint64_t a;
};

inline constexpr spindle::method<long(spindle::UniqueFd, std::string)> write_to{"fds.write_to"};
inline constexpr spindle::method<long(spindle::UniqueFd, spindle::UniqueFd)> write_both{"fds.write_both"};
inline constexpr spindle::method<bool(spindle::UniqueFd)> is_empty{"fds.is_empty"};
inline constexpr spindle::method<long()> fd_count{"fds.count"};
inline constexpr spindle::method<long(spindle::UniqueFd, std::uint64_t)> put_record{"slots.put"};
inline constexpr spindle::method<std::string(spindle::UniqueFd)> attach_other{"slots.attach_other"};

int child_main(spindle::ChildEnv& env) {
  env.expose(write_to, [](spindle::UniqueFd fd, std::string text) {
    return static_cast<long>(::write(fd.get(), text.data(), text.size()));
  });  // the fd closes here: the call's copy was the only one left
  env.expose(write_both, [](spindle::UniqueFd a, spindle::UniqueFd b) {
    return static_cast<long>(::write(a.get(), "a", 1) + ::write(b.get(), "b", 1));
  });
  env.expose(is_empty, [](spindle::UniqueFd fd) { return !fd; });
  env.expose(fd_count, [] { return open_fd_count(); });
  env.expose(put_record, [](spindle::UniqueFd fd, std::uint64_t a) {
    auto slots = spindle::RecordSlots<Record>::attach(std::move(fd));
    auto r = slots.push(Record{a, 0.5});
    return r.status == spindle::SlotStatus::kOk ? static_cast<long>(r.slot) : -1L;
  });
  env.expose(attach_other, [](spindle::UniqueFd fd) {
    spindle::RecordSlots<OtherRecord>::attach(std::move(fd));  // throws: another layout
    return std::string("attached");
  });
  return env.serve();
}

class ApiFds : public ::testing::Test {
 protected:
  spindle::Runtime rt;
  spindle::Child child = rt.fork_child(child_main, {.name = "fds-child"});
};

TEST_F(ApiFds, AGivenUpFdArrivesAndIsClosedOnceEveryoneIsDone) {
  Pipe p = make_pipe();
  EXPECT_EQ(child.call(write_to, std::move(p.write), "hello"), 5);
  EXPECT_FALSE(p.write) << "std::move gave the fd up: the call took it";
  // EOF: no copy of the write end is left, here (the message's) or there.
  EXPECT_EQ(read_to_eof(p.read), "hello");
}

TEST_F(ApiFds, AnLvalueSendsADuplicateAndTheCallerKeepsItsOwn) {
  Pipe p = make_pipe();
  EXPECT_EQ(child.call(write_to, p.write, "one"), 3);
  ASSERT_TRUE(p.write);
  EXPECT_GE(::fcntl(p.write.get(), F_GETFD), 0) << "the caller's fd was closed";
  EXPECT_EQ(::write(p.write.get(), "+", 1), 1);
  p.write.reset();  // now the last copy goes
  EXPECT_EQ(read_to_eof(p.read), "one+");
}

TEST_F(ApiFds, TwoFdsInOneCallAndDupOfARawFd) {
  Pipe a = make_pipe(), b = make_pipe();
  EXPECT_EQ(child.call(write_both, spindle::dup_fd(a.write.get()), std::move(b.write)), 2);
  a.write.reset();
  EXPECT_EQ(read_to_eof(a.read), "a");
  EXPECT_EQ(read_to_eof(b.read), "b");
}

TEST_F(ApiFds, FutureAndCompletionTokenFormsCarryFdsToo) {
  Pipe p = make_pipe(), q = make_pipe();
  auto f = child.call_async(write_to, std::move(p.write), "future");
  // async_call encodes at once and starts when initiated: the fd rides along.
  auto g = child.async_call(write_to, std::move(q.write), "token", asio::use_future);
  EXPECT_EQ(f.get(), 6);
  EXPECT_EQ(g.get(), 5);
  EXPECT_EQ(read_to_eof(p.read), "future");
  EXPECT_EQ(read_to_eof(q.read), "token");
}

TEST_F(ApiFds, AnEmptyUniqueFdArrivesEmpty) {
  EXPECT_TRUE(child.call(is_empty, spindle::UniqueFd()));
  Pipe p = make_pipe();
  EXPECT_FALSE(child.call(is_empty, std::move(p.write)));
}

TEST_F(ApiFds, TheCalleeKeepsNoFdOfACallThatIsOver) {
  const long before = child.call(fd_count);
  for (int i = 0; i < 20; ++i) {
    Pipe p = make_pipe();
    child.call(write_to, std::move(p.write), "x");
    child.call(is_empty, std::move(p.read));
  }
  EXPECT_EQ(child.call(fd_count), before);
}

TEST_F(ApiFds, AnIndexTheMessageDoesNotCarryIsADecodeError) {
  // What a confused peer could send: argument 0 names fd #3 of none.
  msgpack::sbuffer buf;
  spindle::Packer pk(buf);
  pk.pack_array(2);
  pk.pack_ext(1, spindle::kFdExtType);
  const char index = 3;
  pk.pack_ext_body(&index, 1);
  pk.pack(std::string("x"));
  try {
    child.call_named("fds.write_to", spindle::detail::payload_of(std::move(buf)));
    ADD_FAILURE() << "decoded an fd that was never sent";
  } catch (const spindle::CallError& e) {
    EXPECT_EQ(e.type(), spindle::kDecodeErrorType) << e.what();
    EXPECT_NE(e.message().find("fd argument #3, but the message carries 0"), std::string::npos) << e.what();
  }
}

TEST_F(ApiFds, ASlotBufferTravelsAsAnFdArgument) {
  auto slots = spindle::RecordSlots<Record>::create(16);
  EXPECT_EQ(child.call(put_record, spindle::dup_fd(slots.buffer().fd()), std::uint64_t{42}), 0);
  Record r{};
  ASSERT_EQ(slots.read(0, r), spindle::SlotStatus::kOk);
  EXPECT_EQ(r.a, 42u);
  EXPECT_EQ(r.b, 0.5);
  EXPECT_EQ(slots.filled(), 1u);
  try {
    child.call(attach_other, spindle::dup_fd(slots.buffer().fd()));
    ADD_FAILURE() << "attached a buffer of another layout";
  } catch (const spindle::CallError& e) {
    EXPECT_NE(std::string(e.what()).find("another layout"), std::string::npos) << e.what();
  }
  // Not a slot buffer at all: a clear error, and the fd is closed.
  Pipe p = make_pipe();
  EXPECT_THROW(spindle::SlotBuffer::attach(std::move(p.write)), spindle::Error);
}

// A spawned child on pipes (ChildTransport::kStdio) cannot receive fds: the
// call fails with the router's named reason, and the link stays usable.
TEST(ApiFdsRefused, APeerOnPipesRefusesFdArgumentsByName) {
  spindle::Runtime rt;
  spindle::Child c = rt.spawn_child(SPINDLE_HELPER_DIR "/spawned_typed", {},
                                    {.name = "on-pipes", .transport = spindle::ChildTransport::kStdio});
  Pipe p = make_pipe();
  try {
    c.call(write_to, std::move(p.write), "lost?");
    ADD_FAILURE() << "fds were sent to a peer that cannot take them";
  } catch (const spindle::ChannelError& e) {
    EXPECT_NE(std::string(e.what()).find("peer cannot take file descriptors"), std::string::npos) << e.what();
  }
  // The refused message's fds were closed here: nobody holds the write end.
  EXPECT_EQ(read_to_eof(p.read), "");
  EXPECT_EQ(c.call(spindle::method<std::string(std::string)>{"echo"}, "still fine"), "still fine");
  EXPECT_EQ(c.stop(), 0);
}

// The same program over a socket takes them.
TEST(ApiFdsRefused, TheSameProgramOnASocketTakesThem) {
  spindle::Runtime rt;
  spindle::Child c = rt.spawn_child(SPINDLE_HELPER_DIR "/spawned_typed", {}, {.name = "on-socket"});
  Pipe p = make_pipe();
  EXPECT_EQ(c.call(write_to, std::move(p.write), "taken"), 5);
  EXPECT_EQ(read_to_eof(p.read), "taken");
  EXPECT_EQ(c.stop(), 0);
}

}  // namespace test_api_fds
