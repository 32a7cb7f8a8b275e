// TxQueue (stream/tx_queue.h): whatever the sizes of the writes, the queue
// counts exactly the frames written whole, frees the blocks behind them,
// and at clear() reports exactly the frames not written whole (the one cut
// in the middle among them), inline frames and entries alike.
#include <sys/uio.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "stream/tx_queue.h"

namespace spindle {
namespace {

struct Queued {
  std::uint32_t reply_to;  // unique: names the frame in clear()'s report
  std::uint64_t end;       // its last byte's position + 1 in the stream
};

Header header_for(std::uint32_t n, std::size_t body) {
  Header h;
  h.dst_id = 7;
  h.handle = 1000;
  h.reply_to = n;
  h.length = static_cast<std::uint32_t>(body);
  return h;
}

// Appends `count` frames of pseudo-random sizes, one in eight a TxFrame
// entry (a body over the inline maximum), and returns where each ends.
std::vector<Queued> fill(TxQueue& q, int count, std::uint32_t seed) {
  std::vector<Queued> out;
  std::uint64_t pos = 0;
  std::uint32_t x = seed;
  for (int i = 0; i < count; ++i) {
    x = x * 1664525u + 1013904223u;
    const auto n = static_cast<std::uint32_t>(1000 + i);  // 999 is IS_DEAD
    if (x % 8 == 0) {
      const std::size_t body = kInlineBodyMax + 1 + (x >> 8) % 20000;
      TxFrame f;
      f.header = encode_header(header_for(n, body));
      f.body = Payload::copy_of(std::string(body, 'e'));
      f.charged = kHeaderSize + body;
      q.append_frame(std::move(f));
      pos += kHeaderSize + body;
    } else {
      const std::size_t body = (x >> 8) % (x % 3 == 0 ? kInlineBodyMax + 1 : 200);
      const std::vector<std::uint8_t> bytes(body, 0x5a);
      q.append_inline(encode_header(header_for(n, body)), bytes.data(), bytes.size());
      pos += kHeaderSize + body;
    }
    out.push_back({n, pos});
  }
  return out;
}

std::uint64_t whole_before(const std::vector<Queued>& frames, std::uint64_t written) {
  return static_cast<std::uint64_t>(
      std::count_if(frames.begin(), frames.end(), [&](const Queued& f) { return f.end <= written; }));
}

// Writes up to `stop` bytes in writes of pseudo-random sizes, checking the
// count and the blocks held after each.
std::uint64_t write_until(TxQueue& q, const std::vector<Queued>& frames, std::uint64_t stop,
                          std::uint32_t seed) {
  std::uint64_t written = 0;
  std::uint32_t x = seed;
  while (written < stop) {
    iovec iov[64];
    const TxQueue::Gather g = q.gather(iov, 64);
    if (g.bytes == 0) break;
    x = x * 1664525u + 1013904223u;
    std::size_t n = std::min<std::size_t>(g.bytes, 1 + x % 70000);
    n = static_cast<std::size_t>(std::min<std::uint64_t>(n, stop - written));
    q.advance(n);
    written += n;
    EXPECT_EQ(q.frames_written(), whole_before(frames, written)) << "after " << written << " bytes";
    // Blocks behind what is written go back: at most the unwritten bytes'
    // blocks, the one the cut frame began in, and the one being filled.
    const std::uint64_t total = frames.empty() ? 0 : frames.back().end;
    EXPECT_LE(q.blocks(), (total - written) / kTxBlockSize + 3) << "after " << written << " bytes";
  }
  return written;
}

TEST(TxQueue, CountsTheFramesWrittenWholeWhateverTheWrites) {
  for (std::uint32_t seed = 1; seed <= 20; ++seed) {
    TxQueue q;
    const auto frames = fill(q, 3000, seed);
    const std::uint64_t total = frames.back().end;
    EXPECT_EQ(write_until(q, frames, total, seed * 7), total);
    EXPECT_TRUE(q.empty());
    EXPECT_EQ(q.frames_written(), frames.size());
    EXPECT_EQ(q.blocks(), 0u) << "an empty queue holds no block";
  }
}

TEST(TxQueue, ClearReportsExactlyTheFramesNotWrittenWhole) {
  for (std::uint32_t seed = 1; seed <= 20; ++seed) {
    TxQueue q;
    const auto frames = fill(q, 2000, seed);
    // Cut somewhere inside the stream: often inside a frame.
    const std::uint64_t cut = frames.back().end * (seed % 9 + 1) / 10 + seed % 13;
    const std::uint64_t written = write_until(q, frames, cut, seed * 3);
    ASSERT_EQ(written, cut);
    const Unsent u = q.clear();
    std::vector<std::uint32_t> want;
    for (const Queued& f : frames)
      if (f.end > written) want.push_back(f.reply_to);
    std::vector<std::uint32_t> got;
    for (const Header& h : u.wanting_reply) got.push_back(h.reply_to);
    EXPECT_EQ(got, want) << "seed " << seed << ", cut at " << written;
    EXPECT_EQ(q.frames_written(), whole_before(frames, written)) << "seed " << seed;
  }
}

}  // namespace
}  // namespace spindle
