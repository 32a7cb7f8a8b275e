// bench_services: the service pool beside its floor, measured in one run.
//
//   wake    hand-off of N trivial jobs from one producer to 1, 2 and 4
//           workers through three wake primitives: per-waiter futex words
//           with direct hand-off (services::LaneSet, what the pool uses),
//           std::counting_semaphore, and a condition variable with
//           notify_one. Floor: the same mutex + deque with no thread
//           handing off (push and pop on one thread). Reports jobs/s and the
//           workers' voluntary context switches per job (the kernel's count
//           of sleeps: 1.0 = one wake per job, more = a herd or wasted wakes).
//   calls   service calls/s through Router + ServiceHost + Pool with 1, 2 and
//           4 workers, from one caller (blocking calls) and from 4 callers
//           (16 calls in flight each). Floor: the same calls to a handler
//           that answers on the broker thread, with no pool.
//           Also: pool wake-ups per message, voluntary switches per message.
//   fds     fds opened per worker when a 64-worker pool starts.
//   fork    fork() from this process while its 4-worker pool is busy (2
//           threads keep 8 calls each in flight to a handler that
//           allocates), against fork() of the same process with the pool
//           idle: the pool's fork guard (services/fork.h) may add at most
//           its 10 ms quiesce limit (issue #11 §4). The child _exit()s.
//
// Usage: bench_services [--quick] [--json PATH]. Rows (bench/report.h; names
// in bench/README.md) go to the --json PATH. Exit status non-zero only on a wrong
// reply or a failed check, never on a figure.
#include <dirent.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <future>
#include <mutex>
#include <semaphore>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench/report.h"
#include "broker/log.h"
#include "router/router.h"
#include "spindle/context.h"
#include "services/client.h"
#include "services/fork.h"
#include "services/host.h"
#include "services/lanes.h"
#include "services/pool.h"
#include "tests/process_util.h"

namespace {

using Clock = std::chrono::steady_clock;
using namespace spindle;
using namespace std::chrono_literals;

bool g_failed = false;
bench::Report g_report("bench_services");

void check(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "FAILED: %s\n", what.c_str());
    g_failed = true;
  }
}

pid_t gettid_() { return static_cast<pid_t>(::syscall(SYS_gettid)); }

long voluntary_switches(pid_t tid) {
  std::ifstream in(fmt::format("/proc/self/task/{}/status", tid));
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("voluntary_ctxt_switches:", 0) == 0) return std::stol(line.substr(24));
  return 0;
}

// ---------------------------------------------------------------- wake

// A queue of ints whose consumers sleep on one of three primitives.
class Handoff {
 public:
  virtual ~Handoff() = default;
  virtual void push(int v) = 0;
  virtual int pop() = 0;  // -1: stop
};

class SemaphoreQueue : public Handoff {
 public:
  void push(int v) override {
    {
      std::lock_guard lk(mu_);
      q_.push_back(v);
    }
    sem_.release();
  }
  int pop() override {
    sem_.acquire();
    std::lock_guard lk(mu_);
    int v = q_.front();
    q_.pop_front();
    return v;
  }

 private:
  std::mutex mu_;
  std::deque<int> q_;
  std::counting_semaphore<1 << 30> sem_{0};
};

class CondvarQueue : public Handoff {
 public:
  void push(int v) override {
    bool wake;
    {
      std::lock_guard lk(mu_);
      q_.push_back(v);
      wake = idle_ > 0;
    }
    if (wake) cv_.notify_one();
  }
  int pop() override {
    std::unique_lock lk(mu_);
    ++idle_;
    cv_.wait(lk, [&] { return !q_.empty(); });
    --idle_;
    int v = q_.front();
    q_.pop_front();
    return v;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<int> q_;
  int idle_ = 0;
};

class FutexQueue : public Handoff {
 public:
  FutexQueue() : lane_(set_.add_lane({})) {}
  void push(int v) override {
    Message m;
    m.header.handle = static_cast<std::uint32_t>(v + 1);
    set_.push(lane_, m);
  }
  // As a pool's worker loop does: each job's done() goes with the next take.
  int pop() override {
    thread_local services::Lane* finished = nullptr;  // a worker's job before this one
    auto t = set_.take(Clock::time_point::max(), std::exchange(finished, nullptr));
    const int v = static_cast<int>(t->msg.header.handle) - 1;
    if (v < 0) set_.done(*t->lane);  // the worker stops: nothing more to take
    else finished = t->lane;
    return v;
  }

 private:
  services::LaneSet set_;
  services::Lane& lane_;
};

struct WakeResult {
  double per_sec;
  double switches_per_job;
  double cpu_us_per_job;  // the whole process's CPU: spinning waiters show here
};

double cpu_seconds() {
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  return ru.ru_utime.tv_sec + ru.ru_stime.tv_sec + (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

// The producer posts `jobs` one at a time, pacing so that workers are often
// idle (the case where the wake primitive matters): every 8 jobs it waits
// for the consumers to catch up.
WakeResult run_handoff(Handoff& q, int workers, int jobs) {
  std::atomic<int> done{0};
  std::atomic<long> switches{0};
  std::vector<std::thread> ts;
  std::atomic<int> ready{0};
  for (int w = 0; w < workers; ++w)
    ts.emplace_back([&] {
      pid_t tid = gettid_();
      ++ready;
      long before = voluntary_switches(tid);
      while (q.pop() >= 0) ++done;
      switches += voluntary_switches(tid) - before;
    });
  while (ready.load() < workers) std::this_thread::yield();
  std::this_thread::sleep_for(5ms);  // let them fall asleep
  auto t0 = Clock::now();
  double cpu0 = cpu_seconds();
  for (int i = 0; i < jobs; ++i) {
    q.push(i);
    if (i % 8 == 7)
      while (done.load() < i + 1) std::this_thread::yield();
  }
  while (done.load() < jobs) std::this_thread::yield();
  double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  double cpu = cpu_seconds() - cpu0;
  for (int w = 0; w < workers; ++w) q.push(-1);
  for (auto& t : ts) t.join();
  check(done.load() == jobs, "every job handed off exactly once");
  // The stop pushes cost one switch per worker at most; not counted as jobs.
  return {jobs / secs, static_cast<double>(switches.load() - workers) / jobs, cpu * 1e6 / jobs};
}

double handoff_floor(int jobs) {
  std::mutex mu;
  std::deque<int> q;
  long sum = 0;
  auto t0 = Clock::now();
  for (int i = 0; i < jobs; ++i) {
    {
      std::lock_guard lk(mu);
      q.push_back(i);
    }
    std::lock_guard lk(mu);
    sum += q.front();
    q.pop_front();
  }
  check(sum == static_cast<long>(jobs) * (jobs - 1) / 2, "floor sum");
  return jobs / std::chrono::duration<double>(Clock::now() - t0).count();
}

void section_wake(int jobs) {
  std::printf("\n== wake: %d jobs handed off, paced in bursts of 8 ==\n", jobs);
  const double floor = handoff_floor(jobs);
  std::printf("floor (one thread, mutex + deque, no hand-off): %.2f M jobs/s\n", floor / 1e6);
  g_report.add("wake_floor_mutex_deque", floor, "jobs/s");
  std::printf("%-36s %8s %12s %16s %14s\n", "primitive", "workers", "jobs/s", "sleeps per job",
              "cpu us/job");
  for (int w : {1, 2, 4}) {
    struct Row {
      const char* name;
      const char* row;  // in row names
      std::function<std::unique_ptr<Handoff>()> make;
    };
    for (const Row& r : {Row{"futex word per waiter (LaneSet)", "futex", [] { return std::unique_ptr<Handoff>(new FutexQueue); }},
                         Row{"std::counting_semaphore", "semaphore", [] { return std::unique_ptr<Handoff>(new SemaphoreQueue); }},
                         Row{"condition_variable notify_one", "condvar", [] { return std::unique_ptr<Handoff>(new CondvarQueue); }}}) {
      auto q = r.make();
      WakeResult res = run_handoff(*q, w, jobs);
      std::printf("%-36s %8d %12.0f %16.2f %14.2f\n", r.name, w, res.per_sec, res.switches_per_job,
                  res.cpu_us_per_job);
      const std::string name = fmt::format("wake_{}_{}_workers", r.row, w);
      g_report.add(name, res.per_sec, "jobs/s");  // the bench prints its floor apart, no ratio
      g_report.add(name + "_sleeps_per_job", res.switches_per_job, "sleeps/job");
      g_report.add(name + "_cpu_us_per_job", res.cpu_us_per_job, "us/job");
    }
  }
}

// ---------------------------------------------------------------- calls

double run_calls(const Context& target, int callers, int calls_each, bool via_service,
                 std::uint32_t raw_handle) {
  std::vector<std::thread> ts;
  auto t0 = Clock::now();
  for (int c = 0; c < callers; ++c)
    ts.emplace_back([&, c] {
      const int depth = callers == 1 ? 1 : 16;
      for (int base = 0; base < calls_each; base += depth) {
        std::vector<std::future<Message>> fs;
        std::vector<std::string> sent;
        for (int i = base; i < std::min(calls_each, base + depth); ++i) {
          sent.push_back(fmt::format("{}:{}", c, i));
          Payload p = Payload::copy_of(sent.back());
          fs.push_back(via_service ? services::call_async(target, "echo", "say", std::move(p))
                                   : target.call_async(raw_handle, std::move(p)));
        }
        for (std::size_t i = 0; i < fs.size(); ++i) {
          std::string got = fs[i].get().text();
          if (got != sent[i]) check(false, "reply " + got + " for " + sent[i]);
        }
      }
    });
  for (auto& t : ts) t.join();
  return callers * calls_each / std::chrono::duration<double>(Clock::now() - t0).count();
}

void section_calls(int calls) {
  std::printf("\n== calls: %d echo calls per caller, in-process (router + broker thread) ==\n", calls);
  std::printf("%-10s %8s %14s %14s %8s %14s %16s\n", "callers", "workers", "pool calls/s", "floor calls/s",
              "ratio", "wakes per msg", "sleeps per msg");
  for (int callers : {1, 4}) {
    for (std::size_t workers : {1u, 2u, 4u}) {
      Broker broker;
      Router router(broker, RouterOptions{.name = "bench"});
      services::PoolOptions po;
      po.threads = workers;
      po.name = "bench";
      services::Pool pool(po);
      services::ServiceHost host(router, pool);
      auto svc = std::make_unique<services::Service>("echo");
      svc->expose("say", services::Access::any(), [](services::Request& r) { return r.args(); });
      host.add(std::move(svc));
      std::uint32_t raw = router.add_handler([&router](Message&& m) { router.reply(m, m.data); });
      Context self(router, router.id(), "self");
      run_calls(self, callers, calls / 10 + 1, true, raw);  // warm-up
      double floor = run_calls(self, callers, calls, false, raw);
      auto before = pool.stats();
      long sw_before = 0;
      for (pid_t t : pool.worker_tids()) sw_before += voluntary_switches(t);
      double rate = run_calls(self, callers, calls, true, raw);
      long sw = -sw_before;
      for (pid_t t : pool.worker_tids()) sw += voluntary_switches(t);
      auto after = pool.stats();
      double msgs = static_cast<double>(after.pushed - before.pushed);
      check(msgs == static_cast<double>(callers) * calls, "every call went through the pool");
      std::printf("%-10d %8zu %14.0f %14.0f %8.2f %14.2f %16.2f\n", callers, workers, rate, floor,
                  rate / floor, (after.wakeups - before.wakeups) / msgs, sw / msgs);
      // pool_calls_1_caller is the 1-worker case; more workers are suffixed.
      std::string name = fmt::format("pool_calls_{}_caller{}", callers, callers == 1 ? "" : "s");
      if (workers > 1) name += fmt::format("_{}_workers", workers);
      g_report.add(name, rate, "calls/s", floor);
      g_report.add(name + "_wakes_per_msg", (after.wakeups - before.wakeups) / msgs, "wakes/msg");
      g_report.add(name + "_sleeps_per_msg", sw / msgs, "sleeps/msg");
    }
  }
}

void section_fds() {
  std::size_t before = testutil::count_open_fds();
  services::PoolOptions po;
  po.threads = 64;
  services::Pool pool(po);
  auto until = Clock::now() + 30s;
  while (pool.stats().idle < 64 && Clock::now() < until) std::this_thread::sleep_for(1ms);
  std::size_t after = testutil::count_open_fds();
  check(pool.stats().idle == 64, "64 workers idle");
  std::printf("\n== fds: a 64-worker pool opened %zd fds: %.2f per worker (Mitogen: 2 per sleeping thread) ==\n",
              static_cast<long>(after) - static_cast<long>(before),
              (static_cast<double>(after) - static_cast<double>(before)) / 64);
  g_report.add("pool_fds_per_worker", (static_cast<double>(after) - static_cast<double>(before)) / 64,
               "fds/worker");
}

// Milliseconds each of `n` fork()s took in the parent; the child exits at once.
std::vector<double> time_forks(int n) {
  std::vector<double> ms;
  for (int i = 0; i < n; ++i) {
    const auto t0 = Clock::now();
    const pid_t pid = ::fork();
    if (pid == 0) ::_exit(0);
    const auto t1 = Clock::now();
    if (pid < 0) {
      check(false, "fork failed");
      break;
    }
    int status = 0;
    check(::waitpid(pid, &status, 0) == pid && WIFEXITED(status), "the forked child exited");
    ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    std::this_thread::sleep_for(2ms);  // let the callers refill the pool between forks
  }
  std::sort(ms.begin(), ms.end());
  return ms;
}

void section_fork(int forks) {
  Broker broker;
  Router router(broker, RouterOptions{.name = "bench"});
  services::PoolOptions po;
  po.threads = 4;
  po.name = "bench";
  services::Pool pool(po);
  services::ServiceHost host(router, pool);
  auto svc = std::make_unique<services::Service>("churn");
  svc->expose("work", services::Access::any(), [](services::Request& r) {
    std::vector<std::string> junk;  // allocator traffic while the process forks
    for (int i = 0; i < 50; ++i) junk.push_back(std::string(100 + i, 'x'));
    return r.args();
  });
  host.add(std::move(svc));
  Context self(router, router.id(), "self");
  const std::vector<double> idle = time_forks(forks);
  std::atomic<bool> go{true};
  std::atomic<long> calls{0};
  std::vector<std::thread> callers;
  for (int t = 0; t < 2; ++t)
    callers.emplace_back([&] {
      while (go.load()) {
        std::vector<std::future<Message>> fs;
        for (int i = 0; i < 8; ++i)
          fs.push_back(services::call_async(self, "churn", "work", Payload::copy_of("w")));
        for (auto& f : fs) check(f.get().text() == "w", "a churn call came back wrong");
        calls += 8;
      }
    });
  while (calls.load() < 1000) std::this_thread::sleep_for(1ms);
  const unsigned long late_before = services::fork_guard::forks_not_quiesced();
  const long calls_before = calls.load();
  const std::vector<double> busy = time_forks(forks);
  const long calls_during = calls.load() - calls_before;
  const unsigned long late = services::fork_guard::forks_not_quiesced() - late_before;
  go = false;
  for (auto& t : callers) t.join();
  auto median = [](const std::vector<double>& v) { return v.empty() ? 0.0 : v[v.size() / 2]; };
  auto worst = [](const std::vector<double>& v) { return v.empty() ? 0.0 : v.back(); };
  std::printf("\n== fork: %d fork()s while 2 callers keep a 4-worker pool busy (%ld calls meanwhile) ==\n"
              "busy: median %.3f ms, max %.3f ms; idle pool (the fork itself): median %.3f ms, max %.3f ms; "
              "target: busy max <= idle max + 10 ms; %lu fork(s) went ahead at the 10 ms quiesce limit\n",
              forks, calls_during, median(busy), worst(busy), median(idle), worst(idle), late);
  g_report.add("pool_busy_fork_ms", median(busy), "ms", median(idle));
  g_report.add("pool_busy_fork_max_ms", worst(busy), "ms", worst(idle));
  g_report.add("pool_busy_forks_at_quiesce_limit", static_cast<double>(late), "forks");
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  bool usage = false;
  try {
    g_report.take_args(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_services: %s\n", e.what());
    usage = true;
  }
  for (int i = 1; i < argc && !usage; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) quick = true;
    else usage = true;
  }
  if (usage) {
    std::fprintf(stderr, "usage: %s [--quick] [--json PATH]\n", argv[0]);
    return 2;
  }
  spindle::log().set_level(spdlog::level::warn);
  section_wake(quick ? 2000 : 200000);
  section_calls(quick ? 300 : 20000);
  section_fds();
  section_fork(quick ? 5 : 100);
  try {
    g_report.finish();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_services: error: %s\n", e.what());
    return 1;
  }
  return g_failed ? 1 : 0;
}
