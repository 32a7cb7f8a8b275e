// spindle-router: the standalone router process.
//
// Listens on a UNIX socket (see router/listener.h) and routes messages between
// the clients that connect to it, Spindle clients (spindle::connect) and stock
// Mitogen 0.3 clients (mitogen.unix.connect) alike. It is the root context
// (id 0) and hosts the built-in services (services/builtin.h: ping, stats) on
// a worker pool; spindle-ctl calls them.
//
// Exit codes (also in --help and docs/ROUTER.md):
//   0  shut down gracefully (SIGTERM, SIGINT)
//   1  a runtime or setup error (cannot bind, bad systemd socket, ...)
//   2  a usage error (bad option or value)
//   3  another process already listens on the address
#include <pthread.h>
#include <sys/resource.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstring>
#include <future>
#include <optional>
#include <string>

#include <asio/signal_set.hpp>
#include <fmt/format.h>

#include "broker/errors.h"
#include "broker/log.h"
#include "router/listener.h"
#include "services/builtin.h"
#include "services/names.h"
#include "services/host.h"
#include "services/pool.h"
#include "tools/options.h"

namespace {

using spindle::log;

constexpr int kExitOk = 0, kExitError = 1, kExitUsage = 2, kExitInUse = 3;

constexpr const char* kUsage = R"(usage: spindle-router [options]

Routes messages between the processes that connect to its UNIX socket:
Spindle clients (spindle::connect) and Mitogen 0.3 clients (mitogen.unix.connect).

options:
  --socket ADDR            where to listen: a path, or @NAME for an abstract
                           socket (default: {default})
  --log-level LEVEL        trace, debug, info, warn, error, critical or off (info)
  --max-message-size SIZE  largest payload accepted, e.g. 65536, 64K, 128M (128M)
  --max-clients N          clients at once, handshaking ones included; 0 = no
                           limit (4096); the uids allowed share it
  --handshake-timeout DUR  close clients that have not completed the handshake
                           in time, e.g. 500ms, 10s (10s)
  --unidirectional         clients may reach the router only, not each other
  --allow-uid UID          also accept clients of this uid (repeatable); by
                           default only this process's uid may connect
  --threads N              worker threads running service calls (2)
  --shutdown-grace DUR     how long a graceful shutdown may drain (5s)
  --wait-spin USEC         microseconds the router's thread (and a waiting
                           service worker) polls for the next message before
                           it sleeps: a message within it costs no wake-up,
                           and up to that much CPU per wait; 0 = never (50)

limits (each peer is charged for what it makes the router hold):
  --high-water-mark SIZE   bytes queued towards one peer before senders are
                           refused with "output queue full" (8M)
  --peer-memory-limit SIZE memory one peer may make the router hold: queued
                           frames, receive chunks, memfd bodies, service work
                           (16K a call awaiting its answer); over it the
                           router stops reading that peer (64M)
  --memory-limit SIZE      all peers together; over it the peers holding more
                           than their fair share are paused (1G)
  --fd-quota N             fds one peer may have in flight through the router (1024)
  --fd-limit N             fds the router may hold for all its peers at once; past
                           it, clients' fds are refused (half of RLIMIT_NOFILE)
  --stall-timeout DUR      disconnect a peer that takes nothing from a full
                           queue for this long; 0 = never (10s)
  --accept-client-logs     accept FORWARD_LOG from clients (marked with their
                           context); by default only children may log here
  --help                   print this help and exit
  --version                print the version and exit

SIGTERM or SIGINT shuts down gracefully: the router stops accepting, tells its
clients (SHUTDOWN), drains what is queued, and exits 0. A second signal ends
the grace period at once. When started by systemd socket activation
(LISTEN_FDS) it uses the socket it was given and ignores --socket.

exit codes: 0 graceful shutdown, 1 runtime or setup error, 2 usage error,
            3 another process already listens on the address
)";

struct Config {
  spindle::RouterOptions router;
  spindle::ListenerOptions listener;
  spindle::services::PoolOptions pool;
  std::chrono::milliseconds grace{5000};
  bool default_address = true;
};

// Returns nullopt after printing help/version (exit 0); throws UsageError.
std::optional<Config> parse(int argc, char** argv) {
  Config c;
  c.router.name = "spindle-router";
  c.router.own_thread_polls = true;  // its broker thread does the forwarding
  c.pool.name = "services";
  c.pool.threads = 2;
  c.listener.address = spindle::default_router_address();
  spindle::tools::Args args(argc, argv);
  while (auto opt = args.next_option()) {
    const std::string& o = *opt;
    if (o == "--help") {
      std::printf("%s", fmt::format(kUsage, fmt::arg("default", c.listener.address.to_string())).c_str());
      return std::nullopt;
    } else if (o == "--version") {
      std::printf("spindle-router %s (protocol %u)\n", SPINDLE_VERSION, spindle::kProtocolVersion);
      return std::nullopt;
    } else if (o == "--socket") {
      c.listener.address = spindle::UnixAddress::parse(args.value(o));
      c.default_address = false;
    } else if (o == "--log-level") {
      spindle::log().set_level(spindle::tools::parse_level(o, args.value(o)));
    } else if (o == "--max-message-size") {
      c.router.max_message_size = static_cast<std::uint32_t>(
          spindle::tools::parse_size(o, args.value(o), 1, spindle::kMaxMaxMessageSize));
    } else if (o == "--max-clients") {
      c.listener.max_clients = spindle::tools::parse_size(o, args.value(o), 0, 1u << 24);
    } else if (o == "--handshake-timeout") {
      c.router.handshake_timeout = spindle::tools::parse_duration(o, args.value(o));
    } else if (o == "--unidirectional") {
      c.router.unidirectional = true;
    } else if (o == "--allow-uid") {
      if (c.listener.allowed_uids.empty()) c.listener.allowed_uids.push_back(::geteuid());
      c.listener.allowed_uids.push_back(
          static_cast<uid_t>(spindle::tools::parse_size(o, args.value(o), 0, 0xfffffffe)));
    } else if (o == "--threads") {
      c.pool.threads = spindle::tools::parse_size(o, args.value(o), 1,
                                                  spindle::services::Pool::kMaxThreads);
    } else if (o == "--shutdown-grace") {
      c.grace = spindle::tools::parse_duration(o, args.value(o));
    } else if (o == "--wait-spin") {
      c.router.wait_spin = std::chrono::microseconds(spindle::tools::parse_size(o, args.value(o), 0, 1000000));
    } else if (o == "--high-water-mark") {
      c.router.high_water_mark = spindle::tools::parse_size(o, args.value(o), 4096, std::size_t{1} << 40);
    } else if (o == "--peer-memory-limit") {
      c.router.peer_memory_limit = spindle::tools::parse_size(o, args.value(o), 1 << 20, std::size_t{1} << 40);
    } else if (o == "--memory-limit") {
      c.router.memory_limit = spindle::tools::parse_size(o, args.value(o), 1 << 20, std::size_t{1} << 44);
    } else if (o == "--fd-limit") {
      c.router.fd_limit = spindle::tools::parse_size(o, args.value(o), 1, 1u << 30);
    } else if (o == "--fd-quota") {
      c.router.fd_quota = spindle::tools::parse_size(o, args.value(o), 1, 1u << 20);
    } else if (o == "--stall-timeout") {
      c.router.stall_timeout = spindle::tools::parse_duration(o, args.value(o));
    } else if (o == "--accept-client-logs") {
      c.router.accept_client_logs = true;
    } else {
      throw spindle::tools::UsageError(fmt::format("unknown option '{}'", o));
    }
  }
  return c;
}

void raise_fd_limit() {
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0) {
    log().warn("getrlimit(RLIMIT_NOFILE): {}", spindle::errno_text(errno));
    return;
  }
  if (rl.rlim_cur == rl.rlim_max) {
    log().info("RLIMIT_NOFILE is {} (already the hard limit)", static_cast<unsigned long>(rl.rlim_cur));
    return;
  }
  rlim_t before = rl.rlim_cur;
  rl.rlim_cur = rl.rlim_max;
  if (::setrlimit(RLIMIT_NOFILE, &rl) != 0)
    log().warn("cannot raise RLIMIT_NOFILE from {} to {}: {}", static_cast<unsigned long>(before),
               static_cast<unsigned long>(rl.rlim_max), spindle::errno_text(errno));
  else
    log().info("raised RLIMIT_NOFILE from {} to {}", static_cast<unsigned long>(before),
               static_cast<unsigned long>(rl.rlim_max));
}

int run(const Config& c) {
  raise_fd_limit();
  if (c.default_address && !c.listener.address.abstract) {
    std::string path = c.listener.address.name;
    spindle::ensure_private_dir(path.substr(0, path.rfind('/')));
  }
  // Hold SIGINT/SIGTERM until the handler below is armed: a signal in
  // between stays pending instead of killing the process without a goodbye.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  ::pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  spindle::Broker::Options broker_opts = spindle::Broker::options_for(c.router);
  broker_opts.shutdown_grace = c.grace;
  spindle::Broker broker(broker_opts);
  spindle::Router router(broker, c.router);
  // Signals are taken on the broker thread (a handler there may log and shut
  // down, which a plain signal handler may not), and armed before the socket
  // exists: a SIGTERM during start-up is a graceful shutdown too.
  std::promise<void> armed;
  asio::signal_set signals(broker.io());
  int received = 0;
  std::function<void(const std::error_code&, int)> on_signal = [&](const std::error_code& ec, int sig) {
    if (ec) return;
    if (++received == 1) {
      log().info("received SIG{}: shutting down gracefully", ::sigabbrev_np(sig));
      broker.shutdown(c.grace);
    } else {
      log().warn("received SIG{} again: ending the grace period now", ::sigabbrev_np(sig));
      broker.shutdown(std::chrono::milliseconds(0));
    }
    signals.async_wait(on_signal);
  };
  broker.defer([&] {
    signals.add(SIGINT);
    signals.add(SIGTERM);
    signals.async_wait(on_signal);
    armed.set_value();
  });
  armed.get_future().wait();
  // Asio's handler runs in this thread from now on (the broker thread keeps
  // them blocked) and hands the signal to the broker thread.
  ::pthread_sigmask(SIG_UNBLOCK, &stop_signals, nullptr);
  spindle::services::Pool pool(c.pool);
  spindle::services::ServiceHost host(router, pool);
  std::unique_ptr<spindle::Listener> listener;
  try {
    listener = spindle::Listener::open(router, c.listener);
  } catch (const spindle::Error& e) {
    log().error("{}", e.what());
    return std::strstr(e.what(), "another process is listening") ? kExitInUse : kExitError;
  }
  host.add(spindle::services::make_ping_service());
  host.add(spindle::services::make_stats_service(router, listener.get()));
  host.add(spindle::services::make_names_service(router));
  try {
    listener->start();
  } catch (const spindle::ShutdownError&) {
    log().info("shutdown requested during start-up: not accepting clients");
  }
  log().info("spindle-router {} ready: pid {}, listening on {}, max message {} bytes{}",
             SPINDLE_VERSION, ::getpid(), listener->address(), c.router.max_message_size,
             c.router.unidirectional ? ", unidirectional" : "");
  broker.wait_for_shutdown_request();
  broker.join();
  log().info("spindle-router stopped");
  return kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
  spindle::set_log_context(0, "spindle-router");
  spindle::set_log_level_from_env(spdlog::level::info);
  std::optional<Config> config;
  try {
    config = parse(argc, argv);
  } catch (const spindle::tools::UsageError& e) {
    std::fprintf(stderr, "spindle-router: %s\n(see spindle-router --help)\n", e.what());
    return kExitUsage;
  } catch (const spindle::Error& e) {
    std::fprintf(stderr, "spindle-router: %s\n(see spindle-router --help)\n", e.what());
    return kExitUsage;
  }
  if (!config) return kExitOk;
  try {
    return run(*config);
  } catch (const std::exception& e) {
    log().error("{}", e.what());
    return kExitError;
  }
}
