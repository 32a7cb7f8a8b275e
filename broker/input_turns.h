// InputTurns: the busy streams' input turns, run round-robin in chunks.
//
// Role: a stream with input left (frames in its chunk, or a socket that
// probably holds more) queues its next turn here instead of posting it to
// Asio. One runner, posted to the loop, runs the queued turns in order, one
// turn per stream at a time, until about kFramesPerChunk frames have been
// delivered, then posts itself again. Asio polls epoll between two chunks:
// a stream that has just become readable (a round trip's reply, a new
// client) waits one chunk, however many streams flood and however large
// their turns are.
//
// Why not one posted handler per turn, as before: Asio polls epoll once per
// pass over its queue, so a newly readable stream waited for every busy
// stream's turn. Keeping that wait short meant small turns (16 frames each
// with 256 streams busy), and a router's destination got a write per 16
// frames: bench_router's 256 raw clients cost the router 330 ns a message
// (the relay floor 109 ns), 16 frames per sendmsg. Chunks separate the two:
// turns of kMinFramesPerTurn frames or more (a write per 64 frames), and a
// wait bounded by the chunk.
//
// The chunk and the turns' share are two constants, because they buy
// different things. The share sets how many frames a destination gets per
// write; the chunk sets how long a newly readable stream waits (a routed
// call waits twice, once per pass through the router). With one constant
// of 4,096 for both, a call through a router that 256 raw clients flooded
// took 2.9-3.2 ms (bench_router, 2026-11-29). A chunk of 1,024 with the
// same share brought that to 0.77 ms, and the flood's own throughput and
// router CPU per message stayed within their run-to-run spread. A chunk of
// 1,024 used as the share too had cost the flood about 10% (turns of a
// quarter the size when a few streams are busy), and a chunk of 256 cost
// 15-40% more router CPU per message for 0.2 ms. A router still corks its
// output for a pass of kChunksPerPass chunks, as it did for one chunk of
// 4,096 frames: flushed per chunk of 1,024, its destinations got 3.5 times
// as many writes.
//
// Thread safety: the loop's thread only (whoever runs the loop).
// Ownership: owned by the Broker; holds a reference on each queued stream
// until its turn runs (or the broker goes). Allocates only when the ring
// grows past the most turns ever queued at once.
#pragma once

#include <cstddef>
#include <memory>

#include <asio/io_context.hpp>

#include "broker/ring.h"

namespace spindle {

class InputTurns {
 public:
  // Frames delivered by the turns of one chunk before epoll is polled.
  static constexpr std::size_t kFramesPerChunk = 1024;
  // The frames shared out among the queued turns: each may deliver
  // kTurnShare / (turns queued + 1), and no more than a chunk.
  static constexpr std::size_t kTurnShare = 4096;
  // A pass: the chunks that deliver about kTurnShare frames. A router corks
  // what the turns forward until a pass ends (router/forward.cpp).
  static constexpr std::size_t kChunksPerPass = kTurnShare / kFramesPerChunk;
  // The smallest number of frames a turn may deliver, however many streams
  // are busy: one client's batch (64 frames, as bench_router's writers and
  // the relay floor write them) goes out in one write.
  static constexpr std::size_t kMinFramesPerTurn = 64;

  // What a stream implements: runs one turn, returns the frames it delivered.
  class Turn {
   public:
    virtual std::size_t run_input_turn() = 0;

   protected:
    ~Turn() = default;
  };

  // `life` expires with the broker: a hosted loop may run the runner later.
  InputTurns(asio::io_context& io, std::weak_ptr<char> life) : io_(io), life_(std::move(life)) {}
  InputTurns(const InputTurns&) = delete;
  InputTurns& operator=(const InputTurns&) = delete;

  void push(std::shared_ptr<Turn> turn);
  // Turns waiting to run.
  std::size_t size() const { return ring_.size(); }
  // Frames a turn may deliver now: its share of kTurnShare among the turns
  // queued, at least kMinFramesPerTurn and at most kFramesPerChunk.
  std::size_t frames_per_turn() const;
  // Whether the last chunk stopped at its frame budget, not at the end of
  // its round of turns: the loop is saturated.
  bool last_chunk_was_full() const { return last_chunk_frames_ >= kFramesPerChunk; }
  // Drops every queued turn (the broker is going).
  void clear();

 private:
  void post_runner();
  void run_chunk();

  asio::io_context& io_;
  std::weak_ptr<char> life_;
  Ring<std::shared_ptr<Turn>> ring_;
  bool runner_posted_ = false;
  bool running_ = false;  // a chunk is under way: it posts the next runner at its end
  std::size_t last_chunk_frames_ = 0;
};

}  // namespace spindle
