// CallTable on its own: slots across the boundaries of its doubling chunks.
//
// The table starts with 64 slots and adds chunks of 64, 128, 256, ... as calls
// pile up (router/call_table.h). Each test below holds thousands of calls open
// at once, so every chunk boundary up to 8,128 slots is crossed, and checks
// that each call keeps its own slot: its own callee, its own reply, and a
// handle that goes stale once the call is over.
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "broker/errors.h"
#include "router/call_table.h"
#include "spindle/message.h"

namespace spindle {
namespace test_call_table {

constexpr int kCalls = 5000;  // past the chunks of 64, 64, 128, ..., 2048

Message reply_from(std::uint32_t callee, std::uint32_t handle, const std::string& text) {
  Message m = Message::make(1, handle, Payload::copy_of(text));
  m.header.src_id = callee;
  return m;
}

TEST(CallTable, ThousandsOfOpenCallsEachKeepTheirOwnSlot) {
  CallTable table;
  std::vector<std::uint32_t> handles;
  std::set<std::uint32_t> distinct;
  for (int i = 0; i < kCalls; ++i) {
    std::uint32_t h = table.open_blocking(100 + static_cast<std::uint32_t>(i));
    EXPECT_TRUE(is_call_handle(h));
    handles.push_back(h);
    distinct.insert(h);
  }
  EXPECT_EQ(distinct.size(), static_cast<std::size_t>(kCalls));
  EXPECT_EQ(table.pending(), static_cast<std::size_t>(kCalls));

  // Complete them out of order: the last chunk first.
  for (int i = kCalls - 1; i >= 0; --i) {
    const std::uint32_t callee = 100 + static_cast<std::uint32_t>(i);
    ASSERT_EQ(table.callee_of(handles[i]), callee) << "call " << i;
    // Another context may not answer it.
    EXPECT_EQ(table.complete(handles[i], reply_from(callee + 1, handles[i], "forged")),
              CallTable::Verdict::kWrongSender);
    ASSERT_EQ(table.complete(handles[i], reply_from(callee, handles[i], "reply " + std::to_string(i))),
              CallTable::Verdict::kCompleted)
        << "call " << i;
  }
  for (int i = 0; i < kCalls; ++i) {
    Message m = table.wait(handles[i], CallTable::Clock::now(), [] { return std::exception_ptr{}; });
    EXPECT_EQ(m.text(), "reply " + std::to_string(i));
  }
  EXPECT_EQ(table.pending(), 0u);

  // Every handle is stale now, though its slot is free for the next call.
  for (int i = 0; i < kCalls; i += 97)
    EXPECT_EQ(table.complete(handles[i], reply_from(100 + static_cast<std::uint32_t>(i), handles[i], "late")),
              CallTable::Verdict::kStale);
  // Reusing the slots (a second generation) makes handles that differ from
  // the old ones, and takes no slot twice.
  std::set<std::uint32_t> second;
  for (int i = 0; i < kCalls; ++i) {
    std::uint32_t h = table.open_blocking(7);
    EXPECT_EQ(distinct.count(h), 0u) << "a reused slot gave out an old handle";
    second.insert(h);
  }
  EXPECT_EQ(second.size(), static_cast<std::size_t>(kCalls));
  for (std::uint32_t h : second) table.abandon(h);
  EXPECT_EQ(table.pending(), 0u);
}

TEST(CallTable, AsyncCallsAcrossChunksCompleteOnceAndFailWhereTheirCalleeIsGone) {
  CallTable table;
  std::vector<std::uint32_t> handles;
  std::vector<int> replies(kCalls, 0), errors(kCalls, 0);
  for (int i = 0; i < kCalls; ++i) {
    const std::uint32_t callee = (i % 2) ? 1000 : 2000;  // odd calls go to 1000
    handles.push_back(table.open_async(callee, [&, i](Message&&, std::exception_ptr e) {
      (e ? errors : replies)[static_cast<std::size_t>(i)] += 1;
    }));
  }
  // Context 1000 goes away: its calls fail, one pass over the slots.
  std::size_t visited = table.fail_where(
      [](std::uint32_t callee) { return callee == 1000; },
      [](std::uint32_t callee) {
        return std::make_exception_ptr(ChannelError("gone: " + std::to_string(callee)));
      });
  EXPECT_GE(visited, static_cast<std::size_t>(kCalls));
  EXPECT_EQ(table.pending(), static_cast<std::size_t>(kCalls / 2));
  for (int i = 0; i < kCalls; ++i) {
    const std::uint32_t callee = (i % 2) ? 1000 : 2000;
    auto v = table.complete(handles[i], reply_from(callee, handles[i], "ok"));
    EXPECT_EQ(v, (i % 2) ? CallTable::Verdict::kStale : CallTable::Verdict::kCompleted) << "call " << i;
  }
  for (int i = 0; i < kCalls; ++i) {
    EXPECT_EQ(replies[i] + errors[i], 1) << "call " << i << " was not completed exactly once";
    EXPECT_EQ(errors[i], i % 2) << "call " << i;
  }
  EXPECT_EQ(table.pending(), 0u);
}

}  // namespace test_call_table
}  // namespace spindle
