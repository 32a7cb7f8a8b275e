// SectionGate (broker/section_gate.h): a closer that has waited for the gate
// to empty never overlaps a section, in either ordering mode; a refused
// enter leaves no mark; nesting past a slot's stack, more threads than the
// table and a fork with a thread inside all keep the rule.
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "broker/section_gate.h"

namespace spindle {
namespace {

using namespace std::chrono_literals;

TEST(SectionGate, EntersUntilClosedThenRefuses) {
  SectionGate g;
  {
    SectionGate::Scope a(g);
    ASSERT_TRUE(a);
    SectionGate::Scope b(g);  // nested, same gate
    ASSERT_TRUE(b);
    g.close();
    EXPECT_FALSE(g.empty()) << "two sections are still open";
    SectionGate::Scope c(g);
    EXPECT_FALSE(c) << "a closed gate refuses, even to a thread inside it";
  }
  EXPECT_TRUE(g.empty());
  EXPECT_TRUE(g.closed());
}

TEST(SectionGate, ARefusedEnterLeavesNoMark) {
  SectionGate g;
  g.close();
  for (int i = 0; i < 100; ++i) EXPECT_EQ(g.enter(), SectionGate::kRefused);
  EXPECT_TRUE(g.empty());
}

TEST(SectionGate, NestingPastTheSlotStackUsesTheSharedCount) {
  SectionGate g;
  std::vector<std::unique_ptr<SectionGate::Scope>> scopes;
  for (int i = 0; i < 20; ++i) {
    scopes.push_back(std::make_unique<SectionGate::Scope>(g));
    ASSERT_TRUE(*scopes.back());
  }
  g.close();
  while (!scopes.empty()) {
    EXPECT_FALSE(g.empty()) << scopes.size() << " sections open";
    scopes.pop_back();
  }
  EXPECT_TRUE(g.empty());
}

TEST(SectionGate, GatesAreIndependent) {
  SectionGate a, b;
  SectionGate::Scope in_b(b);
  ASSERT_TRUE(in_b);
  a.close();
  EXPECT_TRUE(a.empty()) << "a section of another gate does not hold this one";
  EXPECT_FALSE(b.empty());
}

// Threads enter and leave as fast as they can, each checking inside that
// the guarded object is alive; the closer closes, waits, then "destroys" it.
// Any section that overlapped the destruction is counted.
void expect_close_never_overlaps_a_section(int threads, int rounds) {
  for (int round = 0; round < rounds; ++round) {
    SectionGate g;
    std::atomic<bool> destroyed{false};
    std::atomic<long> inside{0}, overlaps{0}, entered{0};
    std::atomic<bool> go{false};
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t) {
      ts.emplace_back([&] {
        while (!go.load()) std::this_thread::yield();
        for (;;) {
          SectionGate::Scope s(g);
          if (!s) return;
          inside.fetch_add(1);
          entered.fetch_add(1, std::memory_order_relaxed);
          if (destroyed.load()) overlaps.fetch_add(1);
          inside.fetch_sub(1);
        }
      });
    }
    go = true;
    while (entered.load() < 1000) std::this_thread::yield();
    g.close_and_wait();
    EXPECT_EQ(inside.load(), 0) << "a thread was inside after close_and_wait()";
    destroyed = true;
    for (auto& t : ts) t.join();
    EXPECT_EQ(overlaps.load(), 0);
  }
}

TEST(SectionGate, ACloserThatWaitedNeverOverlapsASection) {
  expect_close_never_overlaps_a_section(4, 50);
}

// The same in the other mode: this test binary again, with membarrier off.
TEST(SectionGate, TheFenceModeKeepsTheSameRule) {
  if (std::getenv("SPINDLE_NO_MEMBARRIER")) {
    EXPECT_FALSE(SectionGate::asymmetric());
    expect_close_never_overlaps_a_section(4, 50);
    return;
  }
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::setenv("SPINDLE_NO_MEMBARRIER", "1", 1);
    ::execl("/proc/self/exe", "spindle_tests", "--gtest_filter=SectionGate.TheFenceModeKeepsTheSameRule",
            static_cast<char*>(nullptr));
    ::_exit(127);
  }
  int st = 0;
  ASSERT_EQ(::waitpid(pid, &st, 0), pid);
  ASSERT_TRUE(WIFEXITED(st));
  EXPECT_EQ(WEXITSTATUS(st), 0) << "the run with SPINDLE_NO_MEMBARRIER=1 failed";
}

TEST(SectionGate, MoreThreadsThanSlotsOverTimeEachGetOne) {
  // Threads come and go: each gives its slot back when it exits, so 3,000
  // short-lived threads, more than the table holds, all find one.
  SectionGate g;
  for (int i = 0; i < 3000; ++i) {
    std::thread([&] {
      SectionGate::Scope s(g);
      ASSERT_TRUE(s);
    }).join();
  }
  g.close();
  EXPECT_TRUE(g.empty());
}

TEST(SectionGate, MoreThreadsAtOnceThanSlotsStillCount) {
  // 1,100 threads inside at once: those past the table use the shared count.
  // They sleep on `leave` (a futex), not in a polling loop: 1,100 threads
  // polling every millisecond made this test 47 s of a TSan run.
  constexpr int kThreads = 1100;
  SectionGate g;
  std::atomic<int> in{0};
  std::atomic<bool> leave{false};
  std::vector<std::thread> ts;
  for (int i = 0; i < kThreads; ++i) {
    ts.emplace_back([&] {
      SectionGate::Scope s(g);
      in.fetch_add(1);
      leave.wait(false);
    });
  }
  while (in.load() < kThreads) std::this_thread::sleep_for(1ms);
  g.close();
  EXPECT_FALSE(g.empty());
  leave = true;
  leave.notify_all();
  for (auto& t : ts) t.join();
  EXPECT_TRUE(g.empty());
}

// A thread that enters `g` and stays inside until release().
class ThreadInside {
 public:
  explicit ThreadInside(SectionGate& g)
      : thread_([this, &g] {
          SectionGate::Scope s(g);
          inside_ = true;
          while (!leave_.load()) std::this_thread::sleep_for(1ms);
        }) {
    while (!inside_.load()) std::this_thread::sleep_for(1ms);
  }
  ~ThreadInside() { release(); }
  void release() {
    leave_ = true;
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::atomic<bool> inside_{false}, leave_{false};
  std::thread thread_;
};

TEST(SectionGate, AForkedChildDoesNotWaitForAThreadThatStayedInTheParent) {
  SectionGate g;
  ThreadInside t(g);
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    // The thread inside does not exist here; closing must not wait for it.
    g.close_and_wait();
    ::_exit(g.empty() ? 0 : 1);
  }
  int st = 0;
  ASSERT_EQ(::waitpid(pid, &st, 0), pid);
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  g.close();
  EXPECT_FALSE(g.empty()) << "in the parent the thread is still inside";
  t.release();
  EXPECT_TRUE(g.empty());
}

TEST(SectionGate, AForkedChildKeepsTheSectionItsOwnThreadIsIn) {
  // The forking thread's own mark survives into the child: a closer there
  // waits for it, as it would have in the parent.
  SectionGate g;
  std::thread other([&] { SectionGate::Scope s(g); });  // owns a slot, then gives it back
  other.join();
  pid_t pid;
  {
    SectionGate::Scope s(g);
    ASSERT_TRUE(s);
    pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      g.close();
      const bool seen_inside = !g.empty();
      ::_exit(seen_inside ? 0 : 1);
    }
  }
  int st = 0;
  ASSERT_EQ(::waitpid(pid, &st, 0), pid);
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << "the child's closer did not see its own section";
}

TEST(SectionGate, ALiveThreadsMarkIsFoundAfterOthersGaveTheirSlotsBack) {
  // empty() visits only the slots marked owned: 200 threads claim a slot
  // and give it back, and the mark of the one still inside is found.
  SectionGate g;
  for (int i = 0; i < 200; ++i) std::thread([&] { SectionGate::Scope s(g); }).join();
  ThreadInside t(g);
  g.close();
  EXPECT_FALSE(g.empty());
  t.release();
  EXPECT_TRUE(g.empty());
}

}  // namespace
}  // namespace spindle
