// The public Zygote (<spindle/zygote.h>): started first, while the process
// is small; its children are Children of a Runtime like any other (this
// process's children, reaped by ~Child, exit status ours), and they serve
// typed functions, with fd arguments and on a Pool too.
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <string>
#include <string_view>

#include <gtest/gtest.h>

#include <spindle/spindle.h>

namespace test_api_zygote {

using namespace std::chrono_literals;

struct Who {
  long pid = 0, parent = 0;
  std::string arg;
  MSGPACK_DEFINE_MAP(pid, parent, arg)
};

inline constexpr spindle::method<Who()> who{"who"};
inline constexpr spindle::method<long(spindle::UniqueFd, std::string)> write_to{"write_to"};

int answering(spindle::ChildEnv& env, std::string_view arg) {
  env.expose(who, [a = std::string(arg)] { return Who{::getpid(), ::getppid(), a}; });
  env.expose(write_to, [](spindle::UniqueFd fd, std::string s) {
    return static_cast<long>(::write(fd.get(), s.data(), s.size()));
  });
  return env.serve(spindle::Pool{.threads = 2});
}

int exit_with_arg(spindle::ChildEnv&, std::string_view arg) { return std::atoi(std::string(arg).c_str()); }

class ApiZygote : public ::testing::Test {
 protected:
  std::unique_ptr<spindle::Zygote> zygote = spindle::Zygote::start();  // first
  spindle::Runtime rt;
};

TEST_F(ApiZygote, ChildIsThisProcesssChildAndServesTypedCalls) {
  spindle::Child c = zygote->fork_child(rt, answering, "shard-3", {.name = "z-child"});
  EXPECT_EQ(c.name(), "z-child");
  Who w = c.call(who);
  EXPECT_EQ(w.parent, ::getpid()) << "the zygote is pid " << zygote->pid();
  EXPECT_EQ(w.pid, c.pid());
  EXPECT_EQ(w.arg, "shard-3");
  EXPECT_EQ(c.stop(), 0);
}

TEST_F(ApiZygote, FdArgumentsReachAZygoteChild) {
  spindle::Child c = zygote->fork_child(rt, answering, "");
  int p[2];
  ASSERT_EQ(::pipe2(p, O_CLOEXEC), 0);
  spindle::UniqueFd rd(p[0]);
  EXPECT_EQ(c.call(write_to, spindle::UniqueFd(p[1]), "via zygote"), 10);
  char buf[32] = {};
  EXPECT_EQ(::read(rd.get(), buf, sizeof buf), 10);
  EXPECT_EQ(std::string(buf), "via zygote");
}

TEST_F(ApiZygote, ExitCodeIsOursAndTheChildIsReaped) {
  pid_t pid = 0;
  {
    spindle::Child c = zygote->fork_child(rt, exit_with_arg, "7");
    pid = c.pid();
    auto st = c.wait_exit(30s);
    ASSERT_TRUE(st.has_value());
    ASSERT_TRUE(WIFEXITED(*st));
    EXPECT_EQ(WEXITSTATUS(*st), 7);
  }
  errno = 0;
  EXPECT_EQ(::waitpid(pid, nullptr, WNOHANG), -1) << "the child was left unreaped";
  EXPECT_EQ(errno, ECHILD);
}

TEST_F(ApiZygote, AnArgumentOverTheLimitIsAClearError) {
  std::string big(spindle::Zygote::kMaxArg + 1, 'x');
  try {
    zygote->fork_child(rt, exit_with_arg, big);
    ADD_FAILURE() << "no error";
  } catch (const spindle::Error& e) {
    EXPECT_NE(std::string(e.what()).find("over the limit"), std::string::npos) << e.what();
  }
}

TEST_F(ApiZygote, ChildrenOutliveTheZygote) {
  spindle::Child c = zygote->fork_child(rt, answering, "after");
  zygote.reset();  // the zygote process ends; its children are ours
  EXPECT_EQ(c.call(who).arg, "after");
  EXPECT_EQ(c.stop(), 0);
}

}  // namespace test_api_zygote
