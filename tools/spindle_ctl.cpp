// spindle-ctl: asks a running spindle-router what it is doing, and checks
// that a host can run remote contexts.
//
//   spindle-ctl [--socket ADDR] [--timeout DUR] stats [--raw]
//   spindle-ctl [--socket ADDR] [--timeout DUR] ping [TEXT]
//   spindle-ctl [--timeout DUR] ssh HOST [-l USER] [-p PORT] [-i FILE] [-o OPTION]...
//               [--agent PATH] [--remote-dir DIR] [--connect-timeout DUR]
//               [--call NAME [ARGS...]]
//
// stats and ping make it an ordinary Spindle client: it connects, calls the
// router's built-in services (services/builtin.h) and prints the answer.
// ssh needs no router: it starts a remote context with Runtime::ssh() (the
// real ssh client, the agent uploaded if the host lacks it), makes one call
// (spindle.info by default) and prints the answer and how long the start
// and the call took. It is the first thing to run against a new host, so
// its errors are ssh's own words (Runtime::ssh carries ssh's exit status and
// last stderr line). Exit codes: 0 success, 1 the router or host could not
// be reached or the call failed, 2 usage error.
#include <charconv>
#include <chrono>
#include <cstdio>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <spindle/runtime.h>
#include <spindle/ssh.h>

#include "broker/errors.h"
#include "broker/log.h"
#include "router/connect.h"
#include "services/builtin.h"
#include "services/client.h"
#include "tools/options.h"

namespace {

constexpr int kExitOk = 0, kExitError = 1, kExitUsage = 2;

constexpr const char* kUsage = R"(usage: spindle-ctl [options] COMMAND

commands:
  stats [--raw]   clients, messages, bytes and queued bytes per client, and
                  what each makes the router hold
                  (--raw: the router's key=value lines, for scripts)
  ping [TEXT]     a round trip through the router's service pool
  ssh HOST [SSH OPTIONS] [--call NAME [ARGS...]]
                  start a context on HOST over ssh (uploading the agent if
                  needed), make one call, print its answer and the times
                  (default call: spindle.info; --call spindle.echo TEXT)

ssh options (before --call; -p2222 and --port=2222 work too):
  -l, --user USER          -p, --port PORT          -i, --identity FILE
  -o OPTION                passed to ssh as -o OPTION (repeatable)
  --agent PATH             the agent binary to run there (default: $SPINDLE_AGENT,
                           else the installed spindle-agent)
  --remote-dir DIR         where the host caches agents (below its $HOME if
                           relative; default .cache/spindle)
  --connect-timeout DUR    bound on connecting, uploading and the handshake (10s)

options (before COMMAND; --timeout=5s works too):
  --socket ADDR   the router's address: a path or @NAME (default: {default})
  --timeout DUR   give up on a call after this long, more than 0, e.g. 500ms, 5s (10s)
  --help, --version

exit codes: 0 success, 1 router or host unreachable or call failed, 2 usage error
)";

using Record = std::map<std::string, std::string>;

// "kind key=value key=value ..." -> {"": kind, key: value, ...}
Record parse_record(const std::string& line) {
  Record r;
  std::istringstream in(line);
  in >> r[""];
  for (std::string kv; in >> kv;) {
    auto eq = kv.find('=');
    if (eq != std::string::npos) r[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return r;
}

void print_table(const std::string& text) {
  std::istringstream in(text);
  std::vector<Record> clients;
  for (std::string line; std::getline(in, line);) {
    Record r = parse_record(line);
    if (r[""] == "router")
      std::printf("router ctx=%s pid=%s: %s clients, %s messages routed, %s dead replies; "
                  "listener accepted %s, refused %s (uid) %s (full) %s (out of fds)\n",
                  r["id"].c_str(), r["pid"].c_str(), r["clients"].c_str(), r["routed"].c_str(),
                  r["dead_replies"].c_str(), r["accepted"].c_str(), r["refused_uid"].c_str(),
                  r["refused_full"].c_str(), r["refused_no_fds"].c_str());
    if (r[""] == "router")
      std::printf("held for clients: %s of %s bytes of messages (peak %s), %s of %s fds, %s of %s bytes "
                  "of route state\n",
                  r["memory_held"].c_str(), r["memory_limit"].c_str(), r["memory_peak"].c_str(),
                  r["fds_held"].c_str(), r["fd_limit"].c_str(), r["state_held"].c_str(),
                  r["state_limit"].c_str());
    else if (r[""] == "client")
      clients.push_back(std::move(r));
  }
  if (clients.empty()) return;
  // What each client makes the router hold: bytes of messages (paused:
  // no longer read, over its limit), fds, and bytes of route state.
  const char* row = "%6s %-24s %-8s %8s %6s %12s %12s %14s %14s %12s %12s %6s %6s %10s\n";
  std::printf(row, "ctx", "name", "dialect", "pid", "uid", "msgs in", "msgs out", "bytes in", "bytes out",
              "queued", "held", "paused", "fds", "routes");
  for (auto& c : clients)
    std::printf(row, c["id"].c_str(), c["name"].c_str(), c["dialect"].c_str(), c["pid"].c_str(),
                c["uid"].c_str(), c["messages_in"].c_str(), c["messages_out"].c_str(), c["bytes_in"].c_str(),
                c["bytes_out"].c_str(), c["queued_bytes"].c_str(), c["memory_held"].c_str(),
                c["paused"].c_str(), c["fds_held"].c_str(), c["state_held"].c_str());
}


// --- ssh -------------------------------------------------------------------

struct SshCommand {
  std::string host;
  spindle::SshOptions options;
  std::string call = "spindle.info";
  std::vector<std::string> args;  // each passed as a msgpack string
};

int parse_port(const std::string& option, std::string_view v) {
  int port = 0;
  auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), port);
  if (ec != std::errc() || end != v.data() + v.size() || port < 1 || port > 65535)
    throw spindle::tools::UsageError(fmt::format("{}: '{}' is not a port (1 to 65535)", option, v));
  return port;
}

// The words after "ssh". Short options take their value attached or as the
// next word, as ssh's own do; long ones as the next word or after '='.
// Everything after --call NAME is an argument of the call.
SshCommand parse_ssh(const std::vector<std::string>& words) {
  using spindle::tools::UsageError;
  SshCommand c;
  for (std::size_t i = 1; i < words.size(); ++i) {
    std::string opt = words[i];
    std::optional<std::string> attached;
    if (opt.rfind("--", 0) == 0) {
      attached = spindle::tools::split_value(opt);
    } else if (opt.size() > 2 && opt[0] == '-') {
      attached = opt.substr(2);
      opt.resize(2);
    }
    auto value = [&]() -> std::string {
      if (attached) return *attached;
      if (i + 1 >= words.size()) throw UsageError(fmt::format("ssh: {} needs a value", opt));
      return words[++i];
    };
    if (opt == "-l" || opt == "--user") {
      c.options.user = value();
    } else if (opt == "-p" || opt == "--port") {
      c.options.port = parse_port("ssh: " + opt, value());
    } else if (opt == "-i" || opt == "--identity") {
      c.options.identity_file = value();
    } else if (opt == "-o") {
      c.options.ssh_args.insert(c.options.ssh_args.end(), {"-o", value()});
    } else if (opt == "--agent") {
      c.options.agent = value();
    } else if (opt == "--remote-dir") {
      c.options.remote_dir = value();
      if (c.options.remote_dir.empty()) throw UsageError("ssh: --remote-dir needs a directory");
    } else if (opt == "--connect-timeout") {
      c.options.connect_timeout = spindle::tools::parse_duration("ssh: --connect-timeout", value());
      if (c.options.connect_timeout.count() <= 0)
        throw UsageError("ssh: --connect-timeout must be more than 0");
    } else if (opt == "--call") {
      c.call = value();
      if (c.call.empty()) throw UsageError("ssh: --call needs a function name");
      c.args.assign(words.begin() + static_cast<std::ptrdiff_t>(i) + 1, words.end());
      break;
    } else if (opt.empty()) {
      throw UsageError("ssh: an empty argument where HOST was expected");
    } else if (opt[0] == '-') {
      throw UsageError(fmt::format("ssh: unknown option '{}'", words[i]));
    } else if (c.host.empty()) {
      c.host = opt;
    } else {
      throw UsageError(fmt::format("ssh: unexpected argument '{}' (one HOST; call arguments "
                                   "go after --call NAME)", opt));
    }
  }
  // A word that begins with '-' is never the host (it is refused above),
  // so ssh is never handed a "host" it would read as an option.
  if (c.host.empty()) throw UsageError("ssh: no HOST");
  return c;
}

spindle::Payload pack_strings(const std::vector<std::string>& args) {
  msgpack::sbuffer buf;
  spindle::Packer p(buf);
  p.pack_array(static_cast<std::uint32_t>(args.size()));
  for (const auto& a : args) p.pack(a);
  return spindle::Payload::copy_of(std::string_view(buf.data(), buf.size()));
}

// The answer as people read it: spindle.info's fields by name, a string
// as it is (spindle.echo's text), anything else as msgpack-c prints it.
void print_answer(const std::string& call, const spindle::Payload& result) {
  const std::string bytes = result.to_string();
  msgpack::object_handle oh = msgpack::unpack(bytes.data(), bytes.size());
  const msgpack::object& o = oh.get();
  if (call == "spindle.info" && o.type == msgpack::type::ARRAY && o.via.array.size >= 4) {
    auto [host, pid, machine, rss] = o.as<std::tuple<std::string, long, std::string, long>>();
    std::printf("host=%s pid=%ld machine=%s peak_rss_bytes=%ld\n", host.c_str(), pid,
                machine.c_str(), rss);
  } else if (o.type == msgpack::type::STR || o.type == msgpack::type::BIN) {
    const char* p = o.type == msgpack::type::STR ? o.via.str.ptr : o.via.bin.ptr;
    std::size_t n = o.type == msgpack::type::STR ? o.via.str.size : o.via.bin.size;
    std::fwrite(p, 1, n, stdout);
    std::fputc('\n', stdout);
  } else {
    std::ostringstream text;
    text << o;
    std::printf("%s\n", text.str().c_str());
  }
}

int run_ssh(const SshCommand& c, std::chrono::milliseconds call_timeout) {
  using Clock = std::chrono::steady_clock;
  auto ms = [](Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); };
  spindle::Runtime rt;
  const auto t0 = Clock::now();
  spindle::Child remote = rt.ssh(c.host, c.options);
  const auto t1 = Clock::now();
  spindle::Payload result = remote.with_timeout(call_timeout).call_named(c.call, pack_strings(c.args));
  const auto t2 = Clock::now();
  print_answer(c.call, result);
  std::printf("%s: started in %.1f ms (ssh, agent check or upload, handshake); %s answered in %.3f ms\n",
              remote.name().c_str(), ms(t1 - t0), c.call.c_str(), ms(t2 - t1));
  std::fflush(stdout);
  remote.stop();
  return kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
  spindle::set_log_level_from_env(spdlog::level::warn);
  std::string address;
  std::chrono::milliseconds timeout{10000};
  std::vector<std::string> command;
  std::optional<SshCommand> ssh;
  try {
    using spindle::tools::UsageError;
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      if (!command.empty() || a.rfind("--", 0) != 0 || a == "--raw") {
        command.push_back(a);
        continue;
      }
      // "--name value" or "--name=value", as spindle-router takes them.
      std::optional<std::string> attached = spindle::tools::split_value(a);
      if (a == "--help" || a == "--version") {
        if (attached) throw UsageError(fmt::format("{} takes no value", a));
        if (a == "--help")
          std::printf("%s", fmt::format(kUsage, fmt::arg("default",
                                                          spindle::default_router_address().to_string())).c_str());
        else
          std::printf("spindle-ctl %s\n", SPINDLE_VERSION);
        return kExitOk;
      } else if (a == "--socket" || a == "--timeout") {
        if (!attached && i + 1 >= argc) throw UsageError(a + " needs a value");
        std::string v = attached ? *attached : argv[++i];
        if (a == "--socket") {
          address = v;
        } else {
          timeout = spindle::tools::parse_duration(a, v);
          // 0 (or under 1 ms, which rounds down to 0) would time out the
          // connect and every call at once: a usage error, not "unreachable".
          if (timeout.count() <= 0) throw UsageError(fmt::format("--timeout: '{}' must be more than 0", v));
        }
      } else {
        throw UsageError(fmt::format("unknown option '{}'", a));
      }
    }
    if (command.empty()) throw UsageError("no command (stats, ping or ssh)");
    if (command[0] == "ssh") {
      ssh = parse_ssh(command);
    } else if (command[0] == "stats") {
      // Only --raw: anything else is a mistake, not something to ignore.
      for (std::size_t i = 1; i < command.size(); ++i)
        if (command[i] != "--raw" || i > 1)
          throw UsageError(fmt::format("stats: unexpected argument '{}' (stats takes only --raw)", command[i]));
    } else if (command[0] == "ping") {
      if (command.size() > 2)
        throw UsageError(fmt::format("ping: unexpected argument '{}' (one TEXT: quote it if it has spaces)",
                                     command[2]));
    } else {
      throw UsageError(fmt::format("unknown command '{}'", command[0]));
    }
  } catch (const spindle::tools::UsageError& e) {
    std::fprintf(stderr, "spindle-ctl: %s\n(see spindle-ctl --help)\n", e.what());
    return kExitUsage;
  }
  if (ssh) {
    try {
      return run_ssh(*ssh, timeout);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "spindle-ctl: ssh %s: %s\n", ssh->host.c_str(), e.what());
      return kExitError;
    }
  }
  try {
    spindle::RouterOptions ro;
    ro.name = "spindle-ctl";
    ro.handshake_timeout = timeout;
    auto conn = spindle::connect(address, ro);
    auto router = conn->router_context();
    namespace svc = spindle::services;
    if (command[0] == "ping") {
      std::string text = command.size() > 1 ? command[1] : "ping";
      auto t0 = std::chrono::steady_clock::now();
      std::string back = svc::call_text(router, svc::kPingService, svc::kPingMethod, text, timeout);
      auto us = std::chrono::duration_cast<std::chrono::microseconds>(
                    std::chrono::steady_clock::now() - t0).count();
      if (back != text) throw spindle::Error("ping answered with different bytes");
      std::printf("%s: answered in %lld us\n", back.c_str(), static_cast<long long>(us));
    } else {
      std::string text = svc::call_text(router, svc::kStatsService, svc::kStatsMethod, {}, timeout);
      bool raw = command.size() > 1 && command[1] == "--raw";
      if (raw) std::fputs(text.c_str(), stdout);
      else print_table(text);
    }
    return kExitOk;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "spindle-ctl: %s\n", e.what());
    return kExitError;
  }
}
