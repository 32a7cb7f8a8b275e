// `spindle-ctl ssh` as a user meets it: the real spindle-ctl binary against
// a throwaway sshd on 127.0.0.1 (tests/sshd_fixture.h), checked by its exit
// code and what it prints. The fixture's options become the command line a
// user would type (-p, -i, -o, --agent, --remote-dir), so the parsing is
// tested along with the call. Usage errors need no sshd; the rest skip (or
// fail under SPINDLE_REQUIRE_SSHD=1) when sshd cannot start.
#include <sys/wait.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/process_util.h"
#include "tests/sshd_fixture.h"

namespace spindle {
namespace test_ctl_ssh {

using testutil::run_program;
using testutil::TempDir;

int exit_code(int status) { return WIFEXITED(status) ? WEXITSTATUS(status) : -1; }
bool contains(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }

class CtlSsh : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    sshd_ = testing_sshd::Sshd::start(why);
    if (!sshd_) SPINDLE_SSHD_SKIP_OR_FAIL(why);
  }

  // spindle-ctl ssh 127.0.0.1 with the fixture's options as flags, then `tail`.
  std::vector<std::string> command(const std::string& identity, const std::vector<std::string>& tail) const {
    std::vector<std::string> args = {SPINDLE_CTL_BINARY, "--timeout", "20s", "ssh", sshd_->host(),
                                     "-p", std::to_string(sshd_->port()), "-i", identity,
                                     "-o", "UserKnownHostsFile=" + sshd_->known_hosts(),
                                     "-o", "StrictHostKeyChecking=yes", "-oLogLevel=ERROR",
                                     "--agent", testing_sshd::Sshd::default_agent(),
                                     "--remote-dir", sshd_->dir() + "/cache", "--connect-timeout", "20"};
    args.insert(args.end(), tail.begin(), tail.end());
    return args;
  }
  int run(const std::vector<std::string>& args, std::string* out) {
    int st = run_program(args, out, scratch_.path());
    return exit_code(st);
  }

  TempDir scratch_;
  std::unique_ptr<testing_sshd::Sshd> sshd_;
};

TEST(CtlSshUsage, BadUsageExitsTwoWithTheReason) {
  TempDir dir;
  std::string out;
  struct Case {
    std::vector<std::string> args;
    std::string says;
  };
  const std::vector<Case> cases = {
      {{"ssh"}, "no HOST"},
      {{"ssh", "-p"}, "-p needs a value"},
      {{"ssh", "host", "-p", "70000"}, "not a port"},
      {{"ssh", "host", "--port=http"}, "not a port"},
      {{"ssh", "host", "--frobnicate"}, "unknown option '--frobnicate'"},
      {{"ssh", "-oProxyCommand=x"}, "no HOST"},
      {{"ssh", "host", "other"}, "unexpected argument 'other'"},
      {{"ssh", "host", "--connect-timeout", "soon"}, "--connect-timeout"},
      {{"ssh", "host", "--call"}, "--call needs a value"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> args = {SPINDLE_CTL_BINARY};
    args.insert(args.end(), c.args.begin(), c.args.end());
    EXPECT_EQ(exit_code(run_program(args, &out, dir.path())), 2) << out;
    EXPECT_TRUE(contains(out, c.says)) << "expected '" << c.says << "' in: " << out;
  }
  EXPECT_EQ(exit_code(run_program({SPINDLE_CTL_BINARY, "--help"}, &out, dir.path())), 0);
  EXPECT_TRUE(contains(out, "ssh HOST")) << out;
}

TEST_F(CtlSsh, InfoByDefault) {
  std::string out;
  ASSERT_EQ(run(command(sshd_->identity_file(), {}), &out), 0) << out << sshd_->log_tail();
  char host[256] = {};
  ASSERT_EQ(::gethostname(host, sizeof host - 1), 0);
  EXPECT_TRUE(contains(out, std::string("host=") + host + " ")) << out;
  EXPECT_TRUE(contains(out, " pid=")) << out;
  EXPECT_TRUE(contains(out, "machine=")) << out;
  EXPECT_TRUE(contains(out, "spindle.info answered in")) << out;
  EXPECT_TRUE(contains(out, "started in")) << out;
}

TEST_F(CtlSsh, EchoPrintsTheTextBack) {
  std::string out;
  ASSERT_EQ(run(command(sshd_->identity_file(), {"--call", "spindle.echo", "hello over ssh"}), &out), 0)
      << out << sshd_->log_tail();
  EXPECT_TRUE(contains(out, "hello over ssh\n")) << out;  // the text as it is, on a line of its own
  EXPECT_TRUE(contains(out, "spindle.echo answered in")) << out;
}

TEST_F(CtlSsh, RefusedLoginExitsOneWithSshsWords) {
  std::string out;
  EXPECT_EQ(run(command(sshd_->unauthorized_key(), {}), &out), 1) << out;
  EXPECT_TRUE(contains(out, "spindle-ctl: ssh 127.0.0.1:")) << out;
  EXPECT_TRUE(contains(out, "Permission denied")) << out;
}

TEST_F(CtlSsh, UnknownFunctionExitsOne) {
  std::string out;
  EXPECT_EQ(run(command(sshd_->identity_file(), {"--call", "no.such.function"}), &out), 1) << out;
  EXPECT_TRUE(contains(out, "spindle-ctl: ssh 127.0.0.1:")) << out;
}

}  // namespace test_ctl_ssh
}  // namespace spindle
