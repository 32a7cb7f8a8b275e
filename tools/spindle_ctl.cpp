// spindle-ctl: asks a running spindle-router what it is doing.
//
//   spindle-ctl [--socket ADDR] [--timeout DUR] stats [--raw]
//   spindle-ctl [--socket ADDR] [--timeout DUR] ping [TEXT]
//
// It is an ordinary Spindle client: it connects, calls the router's built-in
// services (services/builtin.h) and prints the answer. Exit codes: 0 success,
// 1 the router could not be reached or the call failed, 2 usage error.
#include <cstdio>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>

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
  stats [--raw]   clients, messages, bytes and queued bytes per client
                  (--raw: the router's key=value lines, for scripts)
  ping [TEXT]     a round trip through the router's service pool

options:
  --socket ADDR   the router's address: a path or @NAME (default: {default})
  --timeout DUR   give up after this long, e.g. 500ms, 5s (10s)
  --help, --version

exit codes: 0 success, 1 router unreachable or call failed, 2 usage error
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
    else if (r[""] == "client")
      clients.push_back(std::move(r));
  }
  if (clients.empty()) return;
  std::printf("%6s %-24s %-8s %8s %6s %12s %12s %14s %14s %12s\n", "ctx", "name", "dialect", "pid",
              "uid", "msgs in", "msgs out", "bytes in", "bytes out", "queued");
  for (auto& c : clients)
    std::printf("%6s %-24s %-8s %8s %6s %12s %12s %14s %14s %12s\n", c["id"].c_str(),
                c["name"].c_str(), c["dialect"].c_str(), c["pid"].c_str(), c["uid"].c_str(),
                c["messages_in"].c_str(), c["messages_out"].c_str(), c["bytes_in"].c_str(),
                c["bytes_out"].c_str(), c["queued_bytes"].c_str());
}

}  // namespace

int main(int argc, char** argv) {
  spindle::set_log_level_from_env(spdlog::level::warn);
  std::string address;
  std::chrono::milliseconds timeout{10000};
  std::vector<std::string> command;
  try {
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      if (!command.empty() || a.rfind("--", 0) != 0 || a == "--raw") {
        command.push_back(a);
      } else if (a == "--help") {
        std::printf("%s", fmt::format(kUsage, fmt::arg("default",
                                                        spindle::default_router_address().to_string())).c_str());
        return kExitOk;
      } else if (a == "--version") {
        std::printf("spindle-ctl %s\n", SPINDLE_VERSION);
        return kExitOk;
      } else if (a == "--socket" || a == "--timeout") {
        if (i + 1 >= argc) throw spindle::tools::UsageError(a + " needs a value");
        std::string v = argv[++i];
        if (a == "--socket") address = v;
        else timeout = spindle::tools::parse_duration(a, v);
      } else {
        throw spindle::tools::UsageError(fmt::format("unknown option '{}'", a));
      }
    }
    if (command.empty()) throw spindle::tools::UsageError("no command (stats or ping)");
    if (command[0] != "stats" && command[0] != "ping")
      throw spindle::tools::UsageError(fmt::format("unknown command '{}'", command[0]));
  } catch (const spindle::tools::UsageError& e) {
    std::fprintf(stderr, "spindle-ctl: %s\n(see spindle-ctl --help)\n", e.what());
    return kExitUsage;
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
