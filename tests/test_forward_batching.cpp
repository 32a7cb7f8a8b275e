// Forwarding in batches: what the turns of one pass bring a destination goes
// out in one write, not one per turn (router/forward.cpp).
#include <sys/socket.h>

#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <memory>
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

// Holds a router's broker thread from construction to release(), so that
// what clients write meanwhile waits in their sockets for the next pass.
class HeldBroker {
 public:
  explicit HeldBroker(Router& r) {
    auto parked = std::make_shared<std::promise<void>>();
    auto parked_f = parked->get_future();
    r.broker().defer([parked, go = go_.get_future().share()] {
      parked->set_value();
      go.wait();
    });
    parked_f.wait();
  }
  ~HeldBroker() { release(); }
  void release() {
    if (!released_) go_.set_value();
    released_ = true;
  }

 private:
  std::promise<void> go_;
  bool released_ = false;
};

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

  HeldBroker held(r.router());
  for (int i = 0; i < kPeers; ++i) peers[i].write_all(bursts[i]);
  held.release();

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

// A turn of a frame or two (a call, a reply) is written at its end, not at
// the end of its pass: in a flooded router, a round trip would otherwise
// wait a pass at each hop. Two flooders fill a chunk each, so turns are
// queued when A's single frame for B has its turn; X's frame, next in the
// same pass, runs a handler that holds the router's broker thread. B must
// have A's frame while it is held: with the pass flush only, it came when
// the handler let go.
TEST(ForwardBatching, ASmallTurnIsWrittenAtItsEndNotAtThePassEnd) {
  constexpr std::uint32_t kGate = 2701;
  InProcessRouter r;
  // The handler owns what it touches: it may still be returning from its
  // wait when this test's locals are gone.
  auto entered = std::make_shared<std::promise<void>>();
  auto entered_f = entered->get_future();
  std::promise<void> open;
  r.router().add_handler([entered, open_f = open.get_future().share()](Message&&) {
    entered->set_value();
    open_f.wait();
  }, {}, kGate);
  RawPeer sink = RawPeer::connect_to(r.address()), f1 = RawPeer::connect_to(r.address()),
          f2 = RawPeer::connect_to(r.address()), a = RawPeer::connect_to(r.address()),
          b = RawPeer::connect_to(r.address()), x = RawPeer::connect_to(r.address());
  const std::uint32_t sink_id = sink.handshake(), f1_id = f1.handshake(), f2_id = f2.handshake(),
                      a_id = a.handshake(), b_id = b.handshake(), x_id = x.handshake();
  const int big = 1 << 20;  // the kernel caps it; enough for one burst
  for (RawPeer* p : {&sink, &f1, &f2})
    for (int opt : {SO_SNDBUF, SO_RCVBUF}) ASSERT_EQ(::setsockopt(p->fd, SOL_SOCKET, opt, &big, sizeof big), 0);
  auto burst = [&](std::uint32_t from) {
    std::string out;
    while (out.size() <= 136 * 1024) out += frame_bytes(frame(sink_id, from, from, kHandle, 0), "");
    return out;
  };

  HeldBroker held(r.router());
  f1.write_all(burst(f1_id));
  f2.write_all(burst(f2_id));
  a.write_all(frame_bytes(frame(b_id, a_id, a_id, kHandle, 0), "ping"));
  x.write_all(frame_bytes(frame(r.router().id(), x_id, x_id, kGate, 0), ""));
  held.release();

  const bool gated = entered_f.wait_for(20s) == std::future_status::ready;
  Message m;
  const bool got = gated && b.read_frame(m, 5s);
  open.set_value();
  ASSERT_TRUE(gated) << "the gate's frame never had its turn";
  ASSERT_TRUE(got) << "A's frame waited for the end of the pass, behind the held turn";
  EXPECT_EQ(m.header.src_id, a_id);
  EXPECT_EQ(m.data.to_string(), "ping");
}

}  // namespace test_forward_batching
}  // namespace spindle
