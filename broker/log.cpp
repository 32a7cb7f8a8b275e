// The process logger is a plain pointer swapped with release/acquire: the old
// logger is intentionally leaked on replacement, because another thread may be
// inside it (in the parent) or its mutex may be held forever (in a forked
// child). A handful of leaked loggers per process is the price of never
// deadlocking on one.
#include "broker/log.h"
#include "broker/log_sink.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>

#include <unistd.h>

#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/base_sink.h>

namespace spindle {
namespace {

// "%*" is UtcTime below. spdlog's own time flags call localtime(), which takes
// glibc's tzset lock: a fork() while the broker thread formats a log line would
// leave the child's copy of that lock held forever, and the child hung on its
// first log line (seen in the parent_child demo). UtcTime computes the calendar
// date with integer arithmetic and takes no lock.
constexpr const char* kPattern = "%* %n pid=%P [%l] %v";

class UtcTime final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&, spdlog::memory_buf_t& dest) override {
    using namespace std::chrono;
    auto since = msg.time.time_since_epoch();
    long long ms = duration_cast<milliseconds>(since).count();
    long long secs = ms / 1000;
    long long days = secs / 86400;
    long long rem = secs % 86400;
    // Days to civil date (Howard Hinnant's algorithm), proleptic Gregorian.
    long long z = days + 719468;
    long long era = (z >= 0 ? z : z - 146096) / 146097;
    long long doe = z - era * 146097;
    long long yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    long long y = yoe + era * 400;
    long long doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    long long mp = (5 * doy + 2) / 153;
    long long d = doy - (153 * mp + 2) / 5 + 1;
    long long m = mp < 10 ? mp + 3 : mp - 9;
    if (m <= 2) ++y;
    fmt::format_to(std::back_inserter(dest), "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z", y, m, d,
                   rem / 3600, rem % 3600 / 60, rem % 60, ms % 1000);
  }
  std::unique_ptr<custom_flag_formatter> clone() const override { return std::make_unique<UtcTime>(); }
};

}  // namespace

std::unique_ptr<spdlog::formatter> make_log_formatter() {
  auto f = std::make_unique<spdlog::pattern_formatter>();
  f->add_flag<UtcTime>('*').set_pattern(kPattern);
  return f;
}

namespace {

std::atomic<spdlog::logger*> g_logger{nullptr};

// Every logger ever made stays on this list, so a replaced one is still
// reachable (LeakSanitizer does not report it) and a thread still inside it
// is safe. Pushing is lock-free: a forked child may do it while a lock of the
// parent's is held forever.
struct LoggerNode {
  spdlog::logger* logger;
  LoggerNode* next;
};
std::atomic<LoggerNode*> g_all_loggers{nullptr};

spdlog::logger* keep(spdlog::logger* l) {
  auto* node = new LoggerNode{l, g_all_loggers.load(std::memory_order_relaxed)};
  while (!g_all_loggers.compare_exchange_weak(node->next, node, std::memory_order_release)) {
  }
  return l;
}
std::uint32_t g_context_id = 0;
std::string g_context_name;

// The context's name goes into every record of this process. It is the
// application's, but not always checked yet (a client's name is validated by
// the router it asks): one with a control character is escaped, so that one
// record stays one line.
std::string log_label(const std::string& name) {
  const bool plain = std::all_of(name.begin(), name.end(),
                                 [](unsigned char c) { return c >= 0x20 && c != 0x7f; });
  return plain ? name : fmt::format("{:?}", name);
}

spdlog::logger* make_logger(std::vector<spdlog::sink_ptr> sinks, spdlog::level::level_enum level) {
  if (sinks.empty()) sinks.push_back(stderr_sink());
  std::string name = "ctx=" + std::to_string(g_context_id);
  if (!g_context_name.empty()) name += "(" + log_label(g_context_name) + ")";
  auto* l = new spdlog::logger(name, sinks.begin(), sinks.end());
  l->set_formatter(make_log_formatter());
  l->set_level(level);
  l->flush_on(spdlog::level::warn);
  return keep(l);
}

spdlog::level::level_enum env_level(spdlog::level::level_enum fallback) {
  const char* v = std::getenv("SPINDLE_LOG_LEVEL");
  if (!v || !*v) return fallback;
  auto lvl = spdlog::level::from_str(v);
  // from_str() maps unknown names to "off"; only accept an explicit "off".
  if (lvl == spdlog::level::off && std::string_view(v) != "off") return fallback;
  return lvl;
}

}  // namespace

spdlog::logger& log() {
  spdlog::logger* l = g_logger.load(std::memory_order_acquire);
  if (l) return *l;
  static std::once_flag once;
  std::call_once(once, [] {
    g_logger.store(make_logger({}, env_level(spdlog::level::info)), std::memory_order_release);
  });
  return *g_logger.load(std::memory_order_acquire);
}

void set_log_context(std::uint32_t context_id, const std::string& name) {
  spdlog::logger& old = log();
  g_context_id = context_id;
  g_context_name = name;
  g_logger.store(make_logger(old.sinks(), old.level()), std::memory_order_release);
}

void set_log_sinks(std::vector<spdlog::sink_ptr> sinks) {
  spdlog::logger& old = log();
  g_logger.store(make_logger(std::move(sinks), old.level()), std::memory_order_release);
}

void reset_logging_after_fork(std::uint32_t context_id, const std::string& name,
                              std::vector<spdlog::sink_ptr> sinks) {
  // Read only the level from the inherited logger: its sinks' mutexes may be held.
  spdlog::logger* old = g_logger.load(std::memory_order_acquire);
  auto level = old ? old->level() : env_level(spdlog::level::info);
  g_context_id = context_id;
  g_context_name = name;
  g_logger.store(make_logger(std::move(sinks), level), std::memory_order_release);
}

void set_log_level_from_env(spdlog::level::level_enum fallback) {
  log().set_level(env_level(fallback));
}

}  // namespace spindle
