// The runner takes the turns queued when its chunk starts, each at most
// once, so a stream whose turn queues its next one goes to the back and
// cannot run twice in a chunk; it stops early once the chunk's frames are
// delivered. It posts itself again whenever turns are left, even when a
// turn throws through it (the loop logs the exception), so a listener's
// exception never leaves the queue without a runner.
#include "broker/input_turns.h"

#include <algorithm>
#include <utility>

#include <asio/post.hpp>

namespace spindle {

void InputTurns::push(std::shared_ptr<Turn> turn) {
  ring_.push_back(std::move(turn));
  if (!runner_posted_ && !running_) post_runner();
}

std::size_t InputTurns::frames_per_turn() const {
  return std::clamp(kTurnShare / (ring_.size() + 1), kMinFramesPerTurn, kFramesPerChunk);
}

void InputTurns::clear() { ring_.clear(); }

void InputTurns::post_runner() {
  runner_posted_ = true;
  asio::post(io_, [this, life = life_] {
    if (life.expired()) return;
    run_chunk();
  });
}

void InputTurns::run_chunk() {
  runner_posted_ = false;
  running_ = true;
  std::size_t frames = 0;
  struct Repost {
    InputTurns& q;
    const std::size_t& frames;
    ~Repost() {
      q.running_ = false;
      q.last_chunk_frames_ = frames;
      if (!q.ring_.empty() && !q.runner_posted_) q.post_runner();
    }
  } repost{*this, frames};
  for (std::size_t turns = ring_.size(); turns > 0 && !ring_.empty() && frames < kFramesPerChunk; --turns) {
    std::shared_ptr<Turn> t = std::move(ring_.front());
    ring_.pop_front();
    frames += t->run_input_turn();
  }
}

}  // namespace spindle
