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
  if (count_ == ring_.size()) {
    std::vector<std::shared_ptr<Turn>> grown(std::max<std::size_t>(16, ring_.size() * 2));
    for (std::size_t i = 0; i < count_; ++i) grown[i] = std::move(ring_[(head_ + i) % ring_.size()]);
    ring_ = std::move(grown);
    head_ = 0;
  }
  ring_[(head_ + count_) % ring_.size()] = std::move(turn);
  ++count_;
  if (!runner_posted_ && !running_) post_runner();
}

std::shared_ptr<InputTurns::Turn> InputTurns::pop_front() {
  std::shared_ptr<Turn> t = std::move(ring_[head_]);
  head_ = (head_ + 1) % ring_.size();
  --count_;
  return t;
}

std::size_t InputTurns::frames_per_turn() const {
  return std::max(kMinFramesPerTurn, kFramesPerChunk / (count_ + 1));
}

void InputTurns::clear() {
  while (count_ > 0) pop_front();
}

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
  struct Repost {
    InputTurns& q;
    ~Repost() {
      q.running_ = false;
      if (q.count_ > 0 && !q.runner_posted_) q.post_runner();
    }
  } repost{*this};
  std::size_t frames = 0;
  for (std::size_t turns = count_; turns > 0 && count_ > 0 && frames < kFramesPerChunk; --turns) {
    std::shared_ptr<Turn> t = pop_front();
    frames += t->run_input_turn();
  }
}

}  // namespace spindle
