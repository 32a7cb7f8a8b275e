// The bootstrap script and ssh's argv: see ssh_bootstrap.h.
#include "router/ssh_bootstrap.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <system_error>
#include <tuple>

#include <fmt/format.h>

#include "broker/errors.h"
#include "router/digest.h"

#ifndef SPINDLE_INSTALLED_AGENT
#define SPINDLE_INSTALLED_AGENT ""
#endif

namespace spindle {
namespace {

// The script sh runs (see the header for its rules: no ', \ or newline).
constexpr std::string_view kScript =
    "umask 077; set -f; h=$1; n=$2; c=$3; d=$4; a=$7; "
    "case $d in /*) ;; *) d=$HOME/$d ;; esac; r=$d; "
    "s=$(uname -s); m=$(uname -m); "
    "if [ \"$s $m\" != \"$5 $6\" ]; then "
    "echo \"spindle: the remote host is $s $m, but the agent is built for $5 $6\" >&2; exit 97; fi; "
    // The cache must be ours alone: whoever can write to it, or to a
    // directory above it, could swap the agent between its check and its exec.
    "no() { echo \"spindle: will not run an agent from $r: $1\" >&2; exit 96; }; "
    "mkdir -p \"$d\" || no \"it cannot be created\"; "
    "d=$(cd -P \"$d\" && pwd -P) || no \"it cannot be entered\"; u=$(id -u); q=$d; "
    "while :; do l=$(ls -ldn \"$q\") || no \"$q cannot be inspected\"; set -- $l; "
    "case $1 in d*) ;; *) no \"$q is not a directory\" ;; esac; "
    "[ \"$3\" = \"$u\" ] || { [ \"$3\" = 0 ] && [ \"$q\" != \"$d\" ]; } || no \"$q belongs to uid $3, not to uid $u\"; "
    "case $1 in ?????w*|????????w*) "
    "case $1 in ?????????[tT]*) [ \"$q\" != \"$d\" ] ;; *) false ;; esac || "
    "no \"other users can write to $q (chmod go-w it)\" ;; esac; "
    "[ \"$q\" = / ] && break; q=${q%/*}; q=${q:-/}; done; "
    "f=$d/spindle-agent-$h; "
    "v() { if command -v sha256sum >/dev/null 2>&1; then [ \"$(sha256sum < \"$1\")\" = \"$h  -\" ]; "
    "elif command -v shasum >/dev/null 2>&1; then [ \"$(shasum -a 256 < \"$1\")\" = \"$h  -\" ]; "
    "else [ \"$(cksum < \"$1\")\" = \"$c $n\" ]; fi; }; "
    "if [ ! -h \"$f\" ] && [ -f \"$f\" ] && [ -x \"$f\" ] && v \"$f\"; then echo SPINDLE-RUN; else "
    "t=$d/.upload-$$; rm -f \"$t\"; echo SPINDLE-SEND; "
    "head -c \"$n\" > \"$t\" && v \"$t\" && chmod 700 \"$t\" && mv -f \"$t\" \"$f\" || "
    "{ rm -f \"$t\"; echo \"spindle: the agent upload to $f failed or does not match its checksum\" >&2; "
    "exit 98; }; fi; "
    "SPINDLE_FD=stdio; SPINDLE_CONTEXT_NAME=$a; export SPINDLE_FD SPINDLE_CONTEXT_NAME; exec \"$f\"";

bool plain(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
         std::strchr("._-/+:@,=", c) != nullptr;
}

std::string single_quoted(const std::string& word) { return "'" + word + "'"; }

bool executable(const std::string& path) { return !path.empty() && ::access(path.c_str(), X_OK) == 0; }

}  // namespace

std::shared_ptr<const AgentImage> AgentImage::load(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(fmt::format("ssh: cannot read the agent {}: {}", path, std::strerror(errno)));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    throw Error(fmt::format("ssh: cannot stat the agent {}: {}", path, std::strerror(err)));
  }
  using Key = std::tuple<std::string, dev_t, ino_t, off_t, long, long>;
  Key key{path, st.st_dev, st.st_ino, st.st_size, st.st_mtim.tv_sec, st.st_mtim.tv_nsec};
  static std::mutex mu;
  static std::map<Key, std::shared_ptr<const AgentImage>> cache;
  {
    std::lock_guard lk(mu);
    if (auto it = cache.find(key); it != cache.end()) {
      ::close(fd);
      return it->second;
    }
  }
  auto image = std::make_shared<AgentImage>();
  image->path = path;
  image->bytes.resize(static_cast<std::size_t>(st.st_size));
  std::size_t got = 0;
  while (got < image->bytes.size()) {
    ssize_t n = ::read(fd, image->bytes.data() + got, image->bytes.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int err = n < 0 ? errno : 0;
      ::close(fd);
      throw Error(fmt::format("ssh: cannot read the agent {}: {}", path,
                              err ? std::strerror(err) : "it shrank while being read"));
    }
    got += static_cast<std::size_t>(n);
  }
  ::close(fd);
  image->sha256 = sha256_hex(image->bytes);
  image->cksum = posix_cksum(image->bytes);
  std::lock_guard lk(mu);
  cache.emplace(key, image);  // an older entry for the path stays: agents are few
  return image;
}

std::string own_executable() {
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) throw std::system_error(errno, std::generic_category(), "readlink /proc/self/exe");
  return std::string(buf, static_cast<std::size_t>(n));
}

std::string find_agent(const SshOptions& opts) {
  if (!opts.agent.empty()) {
    if (!executable(opts.agent)) throw Error(fmt::format("ssh: the agent {} is not an executable file", opts.agent));
    return opts.agent;
  }
  std::vector<std::string> tried;
  if (const char* env = std::getenv("SPINDLE_AGENT"); env && *env) {
    if (executable(env)) return env;
    tried.push_back(fmt::format("$SPINDLE_AGENT ({})", env));
  }
  if (executable(SPINDLE_INSTALLED_AGENT)) return SPINDLE_INSTALLED_AGENT;
  if (*SPINDLE_INSTALLED_AGENT) tried.emplace_back(SPINDLE_INSTALLED_AGENT);
  try {
    std::string self = own_executable();
    std::string beside = self.substr(0, self.rfind('/') + 1) + "spindle-agent";
    if (executable(beside)) return beside;
    tried.push_back(beside);
  } catch (const std::exception&) {
  }
  throw Error(fmt::format("ssh: no spindle-agent to run (looked at {}); set SshOptions::agent",
                          fmt::join(tried, ", ")));
}

std::string bootstrap_command(const AgentImage& agent, const std::string& remote_dir,
                              const std::string& name) {
  if (remote_dir.empty())
    throw Error("ssh: remote_dir is empty");
  for (char c : remote_dir)
    if (!plain(c))
      throw Error(fmt::format("ssh: remote_dir {:?} holds a character outside [A-Za-z0-9._-/+:@,=]", remote_dir));
  struct utsname u {};
  if (::uname(&u) != 0) throw std::system_error(errno, std::generic_category(), "uname");
  std::string safe_name = name;
  for (char& c : safe_name)
    if (!plain(c) || c == '/') c = '_';
  std::string system = u.sysname, machine = u.machine;
  for (const std::string* s : {&system, &machine})
    for (char c : *s)
      if (!plain(c)) throw Error(fmt::format("ssh: this host's uname {:?} cannot be passed on", *s));
  return fmt::format("exec /bin/sh -c {} spindle-bootstrap {} {} {} {} {} {} {}", single_quoted(std::string(kScript)),
                     agent.sha256, agent.bytes.size(), agent.cksum, single_quoted(remote_dir), single_quoted(system),
                     single_quoted(machine), single_quoted(safe_name.empty() ? "agent" : safe_name));
}

std::vector<std::string> ssh_argv(const std::string& host, const SshOptions& opts,
                                  const std::string& command) {
  if (host.empty() || host[0] == '-') throw Error(fmt::format("ssh: bad host {:?}", host));
  std::vector<std::string> argv{opts.ssh_program, "-T"};
  auto option = [&](std::string o) {
    argv.emplace_back("-o");
    argv.push_back(std::move(o));
  };
  if (opts.batch_mode) option("BatchMode=yes");
  if (opts.connect_timeout.count() > 0)
    option(fmt::format("ConnectTimeout={}", (opts.connect_timeout.count() + 999) / 1000));
  if (!opts.user.empty()) argv.insert(argv.end(), {"-l", opts.user});
  if (opts.port != 0) {
    if (opts.port < 0 || opts.port > 65535) throw Error(fmt::format("ssh: bad port {}", opts.port));
    argv.insert(argv.end(), {"-p", std::to_string(opts.port)});
  }
  if (!opts.identity_file.empty()) argv.insert(argv.end(), {"-i", opts.identity_file});
  if (!opts.control_path.empty()) {
    option("ControlMaster=auto");
    option("ControlPath=" + opts.control_path);
    option("ControlPersist=60");
  }
  argv.insert(argv.end(), opts.ssh_args.begin(), opts.ssh_args.end());
  argv.insert(argv.end(), {"--", host, command});
  return argv;
}

}  // namespace spindle
