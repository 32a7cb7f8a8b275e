// bench_slots: SlotBuffer writes and samples per second with 1, 2 and 4
// processes, beside the floor and a single-global-lock variant measured in
// the same run on the same machine.
//
//   floor        memcpy of one slot's bytes between private buffers (random
//                slot of a private array of the same size): what a copy costs
//                with no sharing and no locking at all.
//   slots        SlotBuffer::write / SlotBuffer::read of random slots: one
//                seqlock word per slot, in a sealed memfd.
//   global lock  the same slots in shared memory behind ONE process-shared
//                pthread mutex (one multiprocessing.Lock for the whole buffer).
//
// Every process runs for the same wall time after a common start flag, after
// touching every page it will use; figures are totals over the processes,
// best of 3 runs (other load on a shared machine only ever slows a run).
// Reads check the slot's stamp (first word == last word), so a torn read is
// an error, not a number.
//
// Usage: bench_slots [--quick] [--json PATH]
// Rows (bench/report.h; names in bench/README.md) go to the --json PATH.
// Exits 0 whether or not the slot buffer scales; non-zero only on real errors
// (a torn read, a child that failed, a syscall that failed).
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <new>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "bench/report.h"
#include "shm/slot_buffer.h"

namespace {

using Clock = std::chrono::steady_clock;
using spindle::shm::SlotBuffer;
using spindle::shm::SlotStatus;

constexpr int kMaxProcs = 4;

// Shared between the parent and its forked workers.
struct Control {
  std::atomic<int> ready;
  std::atomic<int> go;
  std::atomic<int> stop;
  std::atomic<std::uint64_t> ops[kMaxProcs];
  std::atomic<std::uint64_t> torn;
  std::atomic<std::uint64_t> busy;
  pthread_mutex_t global_lock;  // the contrast: one lock for every slot
};

template <class T>
T* map_shared_anon(std::size_t bytes) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::runtime_error(fmt::format("mmap: {}", std::strerror(errno)));
  return static_cast<T*>(p);
}

// A slot's bytes: every word the same value, so a copy that mixes two writes
// shows up as first word != last word.
void stamp(std::vector<std::byte>& buf, std::uint64_t v) {
  for (std::size_t i = 0; i + 8 <= buf.size(); i += 8) std::memcpy(buf.data() + i, &v, 8);
}
bool whole(const std::byte* p, std::size_t n) { return std::memcmp(p, p + n - 8, 8) == 0; }

// One operation on a random slot; returns false on a torn read.
using Op = std::function<bool(std::size_t slot, std::vector<std::byte>& scratch)>;

struct Case {
  std::string name;
  std::string row;  // in row names
  Op op;
};

// Runs `op` in `procs` forked processes for `duration`; returns ops/s in total.
double run_case(Control& ctl, int procs, std::size_t slots, std::size_t slot_size, const Op& op,
                const std::function<std::uint64_t()>& warm_up, std::chrono::milliseconds duration) {
  ctl.ready = 0;
  ctl.go = 0;
  ctl.stop = 0;
  for (auto& o : ctl.ops) o = 0;
  std::vector<pid_t> pids;
  for (int p = 0; p < procs; ++p) {
    pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error("fork failed");
    if (pid == 0) {
      std::mt19937_64 rng(static_cast<std::uint64_t>(p) + 1);
      std::vector<std::byte> scratch(slot_size);
      std::uint64_t warm = warm_up();
      ctl.ready.fetch_add(1);
      while (ctl.go.load(std::memory_order_acquire) == 0) ::sched_yield();
      std::uint64_t n = 0;
      bool ok = true;
      while (ok && ctl.stop.load(std::memory_order_relaxed) == 0)
        for (int i = 0; i < 64 && ok; ++i, ++n) ok = op(rng() % slots, scratch);
      ctl.ops[p] = n + (warm & 0);  // keep the warm-up reads
      ::_exit(ok ? 0 : 3);
    }
    pids.push_back(pid);
  }
  while (ctl.ready.load() < procs) ::sched_yield();
  auto start = Clock::now();
  ctl.go.store(1, std::memory_order_release);
  std::this_thread::sleep_for(duration);
  ctl.stop.store(1);
  double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  int failed = 0;
  for (pid_t pid : pids) {
    int status = 0;
    if (::waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failed;
  }
  if (failed) throw std::runtime_error(fmt::format("{} worker(s) failed (torn read or crash)", failed));
  std::uint64_t total = 0;
  for (int p = 0; p < procs; ++p) total += ctl.ops[p];
  return static_cast<double>(total) / seconds;
}

void bench_size(spindle::bench::Report& report, Control& ctl, std::size_t slots, std::size_t slot_size, std::chrono::milliseconds duration,
                int repeats) {
  auto buffer = SlotBuffer::create({slots, slot_size});
  // The global-lock variant keeps its slots in shared memory too.
  auto* plain = map_shared_anon<std::byte>(slots * slot_size);
  std::vector<std::byte> fill(slot_size);
  for (std::size_t i = 0; i < slots; ++i) {
    stamp(fill, i);
    if (buffer->write(i, fill) != SlotStatus::kOk) throw std::runtime_error("prefill failed");
    std::memcpy(plain + i * slot_size, fill.data(), slot_size);
  }
  // The floor's private copy of the slots, made before the fork.
  std::vector<std::byte> private_src(slots * slot_size);
  std::memcpy(private_src.data(), plain, slots * slot_size);
  // A forked worker has no page-table entries for shared mappings yet: it
  // touches every page before the clock starts, so no case pays for faults.
  auto warm_up = [&] {
    std::vector<std::byte> buf(slot_size);
    std::uint64_t sum = 0;
    for (std::size_t i = 0; i < slots; ++i) {
      if (buffer->read(i, buf).status != SlotStatus::kOk) throw std::runtime_error("warm-up read failed");
      sum += static_cast<std::uint64_t>(plain[i * slot_size]) + static_cast<std::uint64_t>(private_src[i * slot_size]);
    }
    return sum;
  };

  std::vector<Case> cases = {
      {"floor: memcpy slot -> private", "memcpy_floor",
       [&](std::size_t s, std::vector<std::byte>& buf) {
         std::memcpy(buf.data(), private_src.data() + s * slot_size, slot_size);
         return whole(buf.data(), slot_size);
       }},
      {"slots: write", "write",
       [&](std::size_t s, std::vector<std::byte>& buf) {
         stamp(buf, s);
         if (buffer->write(s, buf) != SlotStatus::kOk) ctl.busy.fetch_add(1);
         return true;
       }},
      {"slots: sample (read)", "sample",
       [&](std::size_t s, std::vector<std::byte>& buf) {
         auto r = buffer->read(s, buf);
         return r.status != SlotStatus::kOk || whole(buf.data(), slot_size);
       }},
      {"global lock: write", "global_lock_write",
       [&](std::size_t s, std::vector<std::byte>& buf) {
         stamp(buf, s);
         pthread_mutex_lock(&ctl.global_lock);
         std::memcpy(plain + s * slot_size, buf.data(), slot_size);
         pthread_mutex_unlock(&ctl.global_lock);
         return true;
       }},
      {"global lock: sample (read)", "global_lock_sample",
       [&](std::size_t s, std::vector<std::byte>& buf) {
         pthread_mutex_lock(&ctl.global_lock);
         std::memcpy(buf.data(), plain + s * slot_size, slot_size);
         pthread_mutex_unlock(&ctl.global_lock);
         return whole(buf.data(), slot_size);
       }},
  };

  std::printf("\n%zu slots of %zu B (%.1f MiB mapped), best of %d x %lld ms per cell, %u CPUs online\n", slots,
              slot_size, static_cast<double>(buffer->mapped_bytes()) / (1 << 20), repeats,
              static_cast<long long>(duration.count()), std::thread::hardware_concurrency());
  std::printf("%-32s %14s %14s %14s %10s\n", "ops/s (total over processes)", "1 proc", "2 procs", "4 procs",
              "4p / 1p");
  double floor[3] = {0, 0, 0};  // the first case is the floor
  for (const Case& c : cases) {
    double r[3];
    int procs[3] = {1, 2, 4};
    for (int i = 0; i < 3; ++i) {
      r[i] = 0;  // best of `repeats`: other load on the machine only ever slows a run down
      for (int k = 0; k < repeats; ++k)
        r[i] = std::max(r[i], run_case(ctl, procs[i], slots, slot_size, c.op, warm_up, duration));
    }
    std::printf("%-32s %14.3g %14.3g %14.3g %9.2fx\n", c.name.c_str(), r[0], r[1], r[2], r[2] / r[0]);
    const bool is_floor = &c == &cases.front();
    const std::string name = fmt::format("slots_{}B_{}", slot_size, c.row);
    for (int i = 0; i < 3; ++i) {
      if (is_floor) floor[i] = r[i];
      report.add(fmt::format("{}_{}p", name, procs[i]), r[i], "ops/s",
                 is_floor ? std::nullopt : std::optional<double>(floor[i]));
    }
    report.add(name + "_4p_over_1p", r[2] / r[0], "x");
  }
  ::munmap(plain, slots * slot_size);
}

}  // namespace

int main(int argc, char** argv) {
  spindle::bench::Report report("bench_slots");
  bool quick = false;
  bool usage = false;
  try {
    report.take_args(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_slots: %s\n", e.what());
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
  try {
    auto* ctl = new (map_shared_anon<Control>(sizeof(Control))) Control{};
    pthread_mutexattr_t attr;
    if (pthread_mutexattr_init(&attr) != 0 || pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED) != 0 ||
        pthread_mutex_init(&ctl->global_lock, &attr) != 0)
      throw std::runtime_error("process-shared mutex");
    pthread_mutexattr_destroy(&attr);
    auto duration = std::chrono::milliseconds(quick ? 20 : 300);
    int repeats = quick ? 1 : 3;
    bench_size(report, *ctl, quick ? 10'000 : 100'000, 256, duration, repeats);
    if (!quick) bench_size(report, *ctl, 16'384, 4096, duration, repeats);
    std::printf("\nbusy writes (slot held past the wait bound): %llu; torn reads: 0 (a torn read exits non-zero)\n",
                static_cast<unsigned long long>(ctl->busy.load()));
    report.add("slots_busy_writes", static_cast<double>(ctl->busy.load()), "writes");
    report.finish();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_slots: %s\n", e.what());
    return 1;
  }
  return 0;
}
