// Remote children over OpenSSH (see <spindle/ssh.h> for what users get).
//
// ssh_child() runs on the caller's thread until the session is usable: it
// spawns ssh with a socket as its stdin and stdout (so that any thread may
// write a frame directly, as on a local child's link) and a pipe as its
// stderr, answers the bootstrap (router/ssh_bootstrap.h)
// by reading the remote's first line from ssh's stdout one byte at a time
// (so that not one byte of the agent's handshake is taken from the stream),
// uploads the agent if asked, and hands stdin/stdout to the router as an
// ordinary child link. ssh's stderr stays with the session: the broker reads
// it, logs each line as the context's (escaped, rate-limited) and keeps the
// last one; when the link closes, the router asks the session why, and the
// answer carries ssh's exit status and that line. Last, it calls the agent's
// spindle.info, so that a session that cannot start fails here, with the
// reason, and not at the user's first call.
//
// With SshOptions::via, the session is started by that context instead (its
// built-in spindle.ssh, served by router/agent.cpp) and routed through it.
//
// Thread safety: any thread but the broker's.
#pragma once

#include <string>
#include <vector>

#include "router/router.h"
#include "spindle/ssh.h"

namespace spindle {

Context ssh_child(Router& parent, const std::string& host, const SshOptions& opts);

// SshOptions as spindle.ssh carries them to a hop ("key=value" words; the
// `via`, `agent` and `router` fields stay behind: a hop uploads its own
// binary, with its own router settings).
std::vector<std::string> encode_hop_options(const SshOptions& opts);
SshOptions decode_hop_options(const std::vector<std::string>& words);

}  // namespace spindle
