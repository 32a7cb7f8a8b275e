// The ssh bootstrap: what runs on the remote host before the agent does.
//
// ssh runs one command line, `exec /bin/sh -c '<script>' spindle-bootstrap
// <sha256> <size> <cksum> <dir> <system> <machine> <name>`, so it needs only
// a POSIX shell whatever the user's login shell is; the script has no single
// quote, backslash or newline, which every login shell (sh, bash, zsh, csh,
// fish) passes through a single-quoted word unchanged. Its arguments are
// checked here against a plain character set, never escaped.
//
// The script refuses a host whose `uname -s`/`uname -m` differ from this
// agent's (exit 97, one stderr line that says both). It refuses a cache
// that anyone but us could write to (exit 96): <dir>, resolved to its
// physical path, must be ours and writable by no one else, and each
// directory above it ours or root's and writable by no one else (or
// sticky), since whoever can write there could swap the agent between its
// check and its exec. If <dir>/spindle-agent-<sha256> is a regular file (not
// a symlink) and its checksum matches (sha256sum, shasum -a 256, or cksum
// where there is neither), it prints "SPINDLE-RUN". Otherwise it
// prints "SPINDLE-SEND", reads exactly <size> bytes from stdin into a
// temporary file of mode 0600, verifies it, makes it 0700 and renames it
// into place (exit 98 if any step fails). Then it execs the agent with the
// link on stdin/stdout. The parent sends nothing after the upload until the
// agent has spoken, so `head -c` cannot read into the frame stream.
//
// Thread safety: pure functions, and AgentImage::load() may be called from
// any thread (it caches under a mutex).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "spindle/ssh.h"

namespace spindle {

// An agent binary as the bootstrap uploads and checks it.
struct AgentImage {
  std::string path;
  std::string bytes;
  std::string sha256;  // hex
  std::uint32_t cksum = 0;
  // Reads the file (cached while its inode, size and mtime stay the same).
  // Throws Error if it cannot be read.
  static std::shared_ptr<const AgentImage> load(const std::string& path);
};

inline constexpr std::string_view kBootstrapRun = "SPINDLE-RUN";
inline constexpr std::string_view kBootstrapSend = "SPINDLE-SEND";
inline constexpr int kBootstrapUnsafeCache = 96;
inline constexpr int kBootstrapWrongHost = 97;
inline constexpr int kBootstrapUploadFailed = 98;

// The agent binary to run: opts.agent, else $SPINDLE_AGENT, else the
// installed one, else spindle-agent beside this program. Throws Error,
// naming every place it looked, if none exists.
std::string find_agent(const SshOptions& opts);
// This program's own binary (what an agent uploads for a hop).
std::string own_executable();

// The remote command line (see above). Throws Error for a remote_dir
// outside the plain character set.
std::string bootstrap_command(const AgentImage& agent, const std::string& remote_dir,
                              const std::string& name);
// argv for ssh: options, then "--", host, command. Throws Error for a host
// that starts with '-' or is empty.
std::vector<std::string> ssh_argv(const std::string& host, const SshOptions& opts,
                                  const std::string& command);

}  // namespace spindle
