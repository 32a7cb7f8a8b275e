// Forwarding in batches: what the turns of one pass bring a destination goes
// out in one write, not one per turn (router/forward.cpp).
#include <sys/socket.h>

#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <string>
#include <vector>

#include "tests/listener_test_util.h"
#include "tests/raw_peer.h"

namespace spindle {
namespace test_forward_batching {

using namespace std::chrono_literals;
using testutil::frame;
using testutil::frame_bytes;
using testutil::InProcessRouter;
using testutil::RawPeer;

constexpr std::uint32_t kHandle = 2700;

// 16 clients send to each other, every one 350 frames to each of the 15
// others: 136 KiB each, waiting in their sockets when the router looks (its
// broker thread is held until they are written). Each read fills a 128 KiB
// chunk, so every stream's next turn is queued behind the others': the
// router is saturated, as under a flood. Flushed per turn, each turn wrote
// to every destination its frames named (4,194 writes in all; 335 now);
// flushed per pass, each destination gets a write per pass.
TEST(ForwardBatching, TheTurnsOfAPassLeaveInOneWritePerDestination) {
  constexpr int kPeers = 16, kEach = 350;
  InProcessRouter r;
  std::vector<RawPeer> peers;
  std::vector<std::uint32_t> ids;
  for (int i = 0; i < kPeers; ++i) {
    peers.push_back(RawPeer::connect_to(r.address()));
    ids.push_back(peers.back().handshake());
    const int big = 1 << 20;  // the kernel caps it; enough for one burst
    ASSERT_EQ(::setsockopt(peers.back().fd, SOL_SOCKET, SO_SNDBUF, &big, sizeof big), 0);
  }
  std::vector<std::string> bursts(kPeers);
  for (int i = 0; i < kPeers; ++i)
    for (int k = 0; k < kEach; ++k)
      for (int j = 0; j < kPeers; ++j)
        if (j != i) bursts[i] += frame_bytes(frame(ids[j], ids[i], ids[i], kHandle, 0), "");
  ASSERT_GT(bursts[0].size(), 128u * 1024) << "each burst must fill a read chunk";

  std::promise<void> parked, go;
  auto go_f = go.get_future();
  r.router().broker().defer([&] {
    parked.set_value();
    go_f.wait();
  });
  parked.get_future().wait();
  for (int i = 0; i < kPeers; ++i) peers[i].write_all(bursts[i]);
  go.set_value();

  // Each peer gets (kPeers - 1) * kEach frames of a bare header.
  const std::size_t expect = static_cast<std::size_t>(kPeers - 1) * kEach * kHeaderSize;
  std::vector<std::uint8_t> in(expect);
  for (int i = 0; i < kPeers; ++i)
    ASSERT_EQ(peers[i].read_exact(in.data(), in.size(), 20s), static_cast<long>(expect)) << "peer " << i;

  std::uint64_t writes = 0, out = 0;
  for (const ClientStats& c : r.router().client_stats()) {
    writes += c.writes;
    out += c.messages_out;
  }
  EXPECT_EQ(out, static_cast<std::uint64_t>(kPeers) * (kPeers - 1) * kEach);
  EXPECT_LT(writes, 1000u) << out << " frames took " << writes << " writes";
  std::printf("%llu frames between %d clients left in %llu writes\n",
              static_cast<unsigned long long>(out), kPeers, static_cast<unsigned long long>(writes));
}

}  // namespace test_forward_batching
}  // namespace spindle
