// replay_buffer: one producer process pushes transitions into a shared slot
// buffer while two sampler processes draw random batches from it.
//
// The parent creates the buffer (a sealed memfd of fixed-size slots, one
// seqlock word per slot) and forks three children with spindle::fork_child.
// Everything between them goes over Spindle: ATTACH hands each child the
// buffer's memfd as a file descriptor in the message (SCM_RIGHTS), START sets them going, STOP ends their loop and its reply carries
// the child's counts (pushes; samples, torn reads, busy or empty slots). The
// records themselves never touch a socket: they go through shared memory.
//
// Each transition carries a checksum of its fields; a sampler that ever saw
// a record whose checksum fails reports it as torn. The program exits 0 only
// if no torn read was seen, the producer pushed and both samplers sampled.
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "broker/errors.h"
#include "broker/log.h"
#include "router/child.h"
#include "spindle/fds.h"
#include "shm/records.h"

namespace {

using spindle::shm::RecordSlots;
using spindle::shm::SlotBuffer;
using spindle::shm::SlotStatus;

constexpr std::uint32_t kAttach = 2200;
constexpr std::uint32_t kStart = 2201;
constexpr std::uint32_t kStop = 2202;
constexpr std::size_t kSlots = 4096;
constexpr std::size_t kBatch = 32;
constexpr auto kRunFor = std::chrono::milliseconds(1500);

// One environment step: ints and arrays, a fixed layout shared by every process.
struct Transition {
  static constexpr std::uint32_t kLayoutId = 1;
  std::uint64_t step;
  std::int32_t action;
  std::int32_t done;
  float reward;
  float observation[32];
  float next_observation[32];
  std::uint64_t checksum;  // of every byte before it
};

std::uint64_t checksum_of(const Transition& t) {
  std::uint64_t h = 1469598103934665603ull;  // FNV-1a
  const auto* p = reinterpret_cast<const unsigned char*>(&t);
  for (std::size_t i = 0; i < offsetof(Transition, checksum); ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

Transition make_transition(std::uint64_t step) {
  Transition t{};
  t.step = step;
  t.action = static_cast<std::int32_t>(step % 7);
  t.done = step % 100 == 99;
  t.reward = static_cast<float>(step % 13) * 0.25f;
  for (int i = 0; i < 32; ++i) {
    t.observation[i] = static_cast<float>(step + static_cast<std::uint64_t>(i));
    t.next_observation[i] = static_cast<float>(step + static_cast<std::uint64_t>(i) + 1);
  }
  t.checksum = checksum_of(t);
  return t;
}

// The buffer travels as a file descriptor in the ATTACH message (SCM_RIGHTS
// over the child's link): the child maps the very same memfd, with its seals.
void share_buffer_fd(const spindle::Context& child, const SlotBuffer& buffer) {
  spindle::Message m = spindle::Message::make(child.id(), kAttach, spindle::Payload::copy_of("slot buffer"));
  const int fd = buffer.fd();
  m.fds = spindle::FdSet::dup_of(std::span<const int>(&fd, 1));
  spindle::Message reply = child.router().call(std::move(m), std::chrono::seconds(10));
  spindle::log().info("{} attached: {}", child.name(), reply.text());
}

std::unique_ptr<SlotBuffer> receive_buffer_fd(const spindle::Message& m) {
  if (m.fds.size() != 1)
    throw spindle::Error(fmt::format("ATTACH expects one fd (the buffer's memfd), got {}", m.fds.size()));
  // The message's fds close with it: attach() gets a duplicate of its own.
  int mine = ::fcntl(m.fds[0], F_DUPFD_CLOEXEC, 3);
  if (mine < 0) throw spindle::Error(fmt::format("dup of the buffer fd: {}", spindle::errno_text(errno)));
  return SlotBuffer::attach(mine);
}

// --- Children -----------------------------------------------------------------
enum class Role { kProducer, kSampler };

// What the broker thread's handlers share with the child's main thread.
struct ChildState {
  std::mutex mu;
  std::unique_ptr<SlotBuffer> buffer;
  std::optional<spindle::Message> stop_request;
  std::atomic<int> phase{0};  // 0 waiting, 1 running, 2 stopping
};

std::string run_producer(RecordSlots<Transition>& slots, ChildState& st) {
  std::uint64_t pushed = 0, busy = 0;
  while (st.phase.load(std::memory_order_acquire) == 1) {
    if (slots.push(make_transition(pushed)).status == SlotStatus::kOk) ++pushed;
    else ++busy;
  }
  return fmt::format("pushes={} busy={}", pushed, busy);
}

std::string run_sampler(RecordSlots<Transition>& slots, ChildState& st, std::uint32_t seed) {
  std::mt19937_64 rng(seed);
  std::uint64_t batches = 0, samples = 0, torn = 0, skipped = 0;
  std::vector<Transition> batch(kBatch);
  while (st.phase.load(std::memory_order_acquire) == 1) {
    std::size_t filled = slots.filled();
    if (filled == 0) {
      std::this_thread::yield();
      continue;
    }
    std::size_t got = 0;
    for (std::size_t i = 0; i < kBatch; ++i) {
      Transition& t = batch[got];
      if (slots.read(rng() % filled, t) != SlotStatus::kOk) {
        ++skipped;  // busy (being written) or not yet written: draw another time
        continue;
      }
      if (t.checksum != checksum_of(t) || t.observation[0] != static_cast<float>(t.step)) ++torn;
      ++got;
    }
    samples += got;
    ++batches;
  }
  return fmt::format("samples={} batches={} torn={} skipped={}", samples, batches, torn, skipped);
}

int child_main(spindle::ChildEnv& env, Role role) {
  auto& router = env.router();
  ChildState st;
  router.add_handler(
      [&](spindle::Message&& m) {
        auto buffer = receive_buffer_fd(m);  // throws: the parent gets CallError
        RecordSlots<Transition> check(*buffer);  // the right record layout?
        std::string text = fmt::format("{} slots of {} bytes", buffer->slot_count(), buffer->slot_size());
        {
          std::lock_guard lk(st.mu);
          st.buffer = std::move(buffer);
        }
        router.reply(m, spindle::Payload::copy_of(text));
      },
      {}, kAttach);
  router.add_handler(
      [&](spindle::Message&& m) {
        st.phase.store(1, std::memory_order_release);
        router.reply(m, spindle::Payload::copy_of("started"));
      },
      {}, kStart);
  router.add_handler(
      [&](spindle::Message&& m) {
        {
          std::lock_guard lk(st.mu);
          st.stop_request = std::move(m);  // answered by main once its loop ends
        }
        st.phase.store(2, std::memory_order_release);
      },
      {}, kStop);
  env.ready();
  while (st.phase.load(std::memory_order_acquire) == 0 && env.broker().accepting())
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::unique_lock lk(st.mu);
  if (!st.buffer) return 1;  // started without a buffer, or the parent went away
  RecordSlots<Transition> slots(*st.buffer);
  lk.unlock();
  std::string report = role == Role::kProducer ? run_producer(slots, st) : run_sampler(slots, st, env.id());
  lk.lock();
  if (st.stop_request) router.reply(*st.stop_request, spindle::Payload::copy_of(report));
  return 0;
}

std::uint64_t field(const std::string& report, const std::string& name) {
  auto at = report.find(name + "=");
  return at == std::string::npos ? 0 : std::stoull(report.substr(at + name.size() + 1));
}

}  // namespace

int main() {
  spindle::set_log_level_from_env(spdlog::level::warn);
  spindle::Broker broker;
  spindle::Router router(broker, {.name = "trainer"});

  auto buffer = RecordSlots<Transition>::create(kSlots);
  std::vector<spindle::Context> children;
  children.push_back(spindle::fork_child(
      router, [](spindle::ChildEnv& e) { return child_main(e, Role::kProducer); }, {.name = "producer", .router = {}}));
  for (int i = 0; i < 2; ++i)
    children.push_back(spindle::fork_child(
        router, [](spindle::ChildEnv& e) { return child_main(e, Role::kSampler); },
        {.name = fmt::format("sampler-{}", i), .router = {}}));

  int failures = 0;
  try {
    for (auto& c : children) share_buffer_fd(c, *buffer);
    for (auto& c : children) c.call(kStart, std::string_view{});
    std::this_thread::sleep_for(kRunFor);
    std::vector<std::future<spindle::Message>> reports;
    for (auto& c : children) reports.push_back(c.call_async(kStop, {}));
    std::uint64_t torn = 0;
    for (std::size_t i = 0; i < children.size(); ++i) {
      std::string report = reports[i].get().text();
      std::printf("%-10s %s\n", children[i].name().c_str(), report.c_str());
      torn += field(report, "torn");
      bool worked = i == 0 ? field(report, "pushes") > 0 : field(report, "samples") > 0;
      if (!worked) ++failures;
    }
    std::printf("torn reads: %llu\n", static_cast<unsigned long long>(torn));
    if (torn != 0) ++failures;
  } catch (const std::exception& e) {
    std::printf("replay_buffer failed: %s\n", e.what());
    ++failures;
    for (auto& c : children) c.shutdown();  // a child still waiting for START exits
  }
  for (auto& c : children) {
    auto st = c.wait_exit(std::chrono::seconds(10));
    if (!st || *st != 0) {
      std::printf("%s: %s\n", c.name().c_str(), st ? spindle::describe_wait_status(*st).c_str() : "did not exit");
      ++failures;
    }
  }
  return failures == 0 ? 0 : 1;
}
