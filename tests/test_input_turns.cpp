// InputTurns (broker/input_turns.h): busy streams' turns in bounded chunks.
//
// What the design promises, checked with stand-in turns on a bare
// io_context: every busy stream gets a turn in its order (round robin, once
// per chunk at most), and a handler that becomes ready meanwhile (what a
// newly readable stream's wait completes with) runs after at most one chunk
// of frames, however many streams are busy. Before the chunks, every turn
// was a handler of its own and such a handler ran only after all of them.
#include <asio/io_context.hpp>
#include <asio/post.hpp>

#include <algorithm>
#include <memory>
#include <stdexcept>
#include <vector>

#include <gtest/gtest.h>

#include "broker/input_turns.h"

namespace spindle {
namespace test_input_turns {

// A stream with `left` turns to take, each delivering `frames` frames; it
// queues its next turn as a stream with input left does.
struct FakeStream : InputTurns::Turn, std::enable_shared_from_this<FakeStream> {
  FakeStream(InputTurns& q, int id, int left, std::size_t frames, std::vector<int>& log)
      : q(q), id(id), left(left), frames(frames), log(log) {}
  std::size_t run_input_turn() override {
    log.push_back(id);
    if (--left > 0) q.push(shared_from_this());
    if (throws_on == left) throw std::runtime_error("a listener threw");
    return frames;
  }
  InputTurns& q;
  int id, left;
  std::size_t frames;
  std::vector<int>& log;
  int throws_on = -1;
};

constexpr int kNewlyReadable = -1;

// A loop, the broker's life token and its queue of turns.
struct InputTurnsOnALoop : ::testing::Test {
  asio::io_context io;
  std::shared_ptr<char> life = std::make_shared<char>();
  InputTurns q{io, life};
  std::vector<int> log;
};

TEST_F(InputTurnsOnALoop, AHandlerReadyMeanwhileWaitsOneChunkNotEveryTurn) {
  std::vector<std::shared_ptr<FakeStream>> streams;
  const std::size_t per_turn = InputTurns::kMinFramesPerTurn;
  const int busy = 256;  // 256 x 64 frames: four chunks per round
  for (int i = 0; i < busy; ++i) {
    streams.push_back(std::make_shared<FakeStream>(q, i, 3, per_turn, log));
    q.push(streams.back());
  }
  asio::post(io, [&] { log.push_back(kNewlyReadable); });
  io.run();

  ASSERT_EQ(log.size(), static_cast<std::size_t>(3 * busy + 1));
  const auto at = static_cast<std::size_t>(std::find(log.begin(), log.end(), kNewlyReadable) - log.begin());
  EXPECT_LE(at * per_turn, InputTurns::kFramesPerChunk)
      << "the handler waited for " << at << " turns (" << at * per_turn << " frames)";
  // Round robin: each stream's turns come in rounds, in the order queued.
  std::vector<int> turns;
  for (int id : log)
    if (id != kNewlyReadable) turns.push_back(id);
  for (std::size_t i = 0; i < turns.size(); ++i) ASSERT_EQ(turns[i], static_cast<int>(i % busy)) << i;
  EXPECT_EQ(q.size(), 0u);
}

TEST_F(InputTurnsOnALoop, ATurnRunsOnceAChunkAndTheShareHasAFloor) {
  auto alone = std::make_shared<FakeStream>(q, 7, 5, 1, log);  // one frame per turn
  q.push(alone);
  EXPECT_EQ(q.frames_per_turn(), std::min(InputTurns::kTurnShare / 2, InputTurns::kFramesPerChunk));
  asio::post(io, [&] { log.push_back(kNewlyReadable); });
  io.run();
  // A stream alone still takes one turn per chunk: the handler ran after its first.
  EXPECT_EQ(log, (std::vector<int>{7, kNewlyReadable, 7, 7, 7, 7}));
  for (int i = 0; i < 1000; ++i) q.push(std::make_shared<FakeStream>(q, i, 1, 1, log));
  EXPECT_EQ(q.frames_per_turn(), InputTurns::kMinFramesPerTurn);
  q.clear();
  EXPECT_EQ(q.size(), 0u);
}

// The share sets the turns' size, the chunk only bounds it: with a few
// streams busy, each still delivers its share of kTurnShare (a destination
// gets one write for that many frames), not a share of the smaller chunk.
TEST_F(InputTurnsOnALoop, TurnsTakeTheirShareOfTheTurnShareUpToAChunk) {
  static_assert(InputTurns::kTurnShare > InputTurns::kFramesPerChunk);
  for (int i = 0; i < 7; ++i) q.push(std::make_shared<FakeStream>(q, i, 1, 1, log));
  EXPECT_EQ(q.frames_per_turn(), InputTurns::kTurnShare / 8);
  EXPECT_GT(q.frames_per_turn(), InputTurns::kFramesPerChunk / 8);
  q.clear();
  q.push(std::make_shared<FakeStream>(q, 0, 1, 1, log));
  EXPECT_EQ(q.frames_per_turn(), InputTurns::kFramesPerChunk) << "a turn is never longer than a chunk";
  q.clear();
}

// A chunk is full when it stopped at its frame budget (the loop is
// saturated: a router keeps corking its output for the pass), not when it
// ran its round of turns under the budget (a router flushes then).
TEST_F(InputTurnsOnALoop, AChunkIsFullOnlyWhenItStopsAtItsBudget) {
  q.push(std::make_shared<FakeStream>(q, 1, 1, 10, log));
  io.run();
  EXPECT_FALSE(q.last_chunk_was_full()) << "one turn of 10 frames";
  io.restart();
  for (int i = 0; i < 8; ++i)
    q.push(std::make_shared<FakeStream>(q, i, 2, InputTurns::kFramesPerChunk / 4, log));
  ASSERT_EQ(io.run_one(), 1u);  // the first chunk: four turns reach the budget
  EXPECT_TRUE(q.last_chunk_was_full());
  EXPECT_EQ(q.size(), 8u) << "four turns ran, and each queued its next";
  q.clear();
}

TEST_F(InputTurnsOnALoop, ATurnThatThrowsLeavesTheOthersARunner) {
  auto a = std::make_shared<FakeStream>(q, 1, 2, 1, log);
  auto b = std::make_shared<FakeStream>(q, 2, 2, 1, log);
  a->throws_on = 1;  // its first turn throws, after queueing its next
  q.push(a);
  q.push(b);
  EXPECT_THROW(io.run(), std::runtime_error);
  io.restart();
  io.run();
  EXPECT_EQ(log, (std::vector<int>{1, 2, 1, 2}));
  EXPECT_EQ(q.size(), 0u);
}

TEST(InputTurns, NothingRunsOnceTheBrokerHasGone) {
  asio::io_context io;
  auto life = std::make_shared<char>();
  std::vector<int> log;
  {
    InputTurns q(io, life);
    q.push(std::make_shared<FakeStream>(q, 1, 1, 1, log));
    q.clear();
  }
  life.reset();  // the broker's end: its runner is still posted on the loop
  io.run();
  EXPECT_TRUE(log.empty());
}

}  // namespace test_input_turns
}  // namespace spindle
