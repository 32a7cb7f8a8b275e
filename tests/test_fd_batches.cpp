// fds in batches (docs/PROTOCOL.md §13.3): between peers that both announce
// kFlagFdBatches, one sendmsg carries the fds of several SF frames, and the
// receiver binds them by count, starting from the batch head's batch_fds.
// Each frame must still get exactly its own fds, a peer without the flag
// must still get one SF frame per sendmsg, and every way a peer can get a
// batch wrong is a protocol error that names it.
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <future>
#include <memory>
#include <thread>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "router/child.h"
#include "router/reasons.h"
#include "router/router.h"
#include "stream/fd_control.h"
#include "stream/fd_frame.h"
#include "stream/handshake.h"
#include "tests/fds_test_util.h"
#include "tests/raw_peer.h"
#include "tests/router_test_util.h"
#include "tests/stream_test_util.h"

namespace spindle {
namespace test_fd_batches {

using namespace std::chrono_literals;
using namespace testutil;

constexpr std::uint32_t kMax = 1u << 20;

std::unique_ptr<Handshake> server_handshake() {
  return std::make_unique<ServerHandshake>(0, static_cast<std::uint32_t>(::getpid()), kMax,
                                           [](const PeerInfo&) { return std::uint32_t{7}; });
}

// A queue of messages with 1, 2 or 5 fds (and one with 253, more than any
// batch may hold beside others), with plain frames between some of them,
// goes out in a few sendmsgs, and each message arrives with its own fds.
TEST(FdBatches, ManySfFramesGoInFewSendmsgsEachWithItsOwnFds) {
  FdRecorder tx_rec, rx_rec;
  StreamHarness h;
  FdPair sp = make_socketpair();
  Stream* tx = h.make(sp.a, sp.a, &tx_rec, {}, std::make_unique<ClientHandshake>(1, kFlagNone));
  Stream* rx = h.make(sp.b, sp.b, &rx_rec, {}, server_handshake());
  ASSERT_TRUE(tx_rec.wait([&] { return tx_rec.opened == 1; }));
  ASSERT_TRUE(h.on([&] { return tx->peer_takes_fd_batches(); })) << "the server did not announce batches";
  constexpr std::size_t kSf = 300;
  std::vector<std::vector<std::pair<dev_t, ino_t>>> sent;
  std::size_t fds_total = 0, messages = 0;
  std::vector<Message> queue;
  for (std::size_t i = 0; i < kSf; ++i) {
    const std::size_t n = i == 150 ? kMaxFdsPerMessage : (i % 3 == 0 ? 1 : i % 3 == 1 ? 2 : 5);
    auto fds = pipe_fds(n);
    sent.push_back(identities(fds));
    fds_total += n;
    Message m = make_msg(static_cast<std::uint32_t>(1000 + i), "sf " + std::to_string(i));
    m.fds = FdSet(std::move(fds));
    queue.push_back(std::move(m));
    if (i % 7 == 0) queue.push_back(make_msg(static_cast<std::uint32_t>(5000 + i), "plain"));
  }
  messages = queue.size();
  h.on([&] {
    for (Message& m : queue) tx->enqueue(std::move(m), 0);
    tx->flush();
  });
  ASSERT_TRUE(rx_rec.wait_messages(messages));
  const auto tx_stats = h.on([&] { return tx->stats(); });
  EXPECT_EQ(tx_stats.fds_out, fds_total);
  EXPECT_EQ(h.on([&] { return rx->stats().fds_in; }), fds_total);
  // Without batches: one sendmsg per SF frame, 300 or more.
  std::printf("%zu SF frames (%zu fds) and %zu plain frames went in %llu writes\n", kSf, fds_total,
              messages - kSf, static_cast<unsigned long long>(tx_stats.writes));
  EXPECT_LT(tx_stats.writes, kSf / 10) << "the fds of several frames did not share a sendmsg";
  std::lock_guard lk(rx_rec.mu);
  ASSERT_EQ(rx_rec.messages.size(), messages);
  std::size_t sf = 0;
  for (const Message& m : rx_rec.messages) {
    if (m.header.handle >= 5000) {
      EXPECT_TRUE(m.fds.empty());
      continue;
    }
    ASSERT_EQ(m.header.handle, 1000 + sf) << "out of order";
    EXPECT_EQ(m.text(), "sf " + std::to_string(sf));
    EXPECT_EQ(m.header.enc, kEncRaw) << "the inner enc is restored";
    EXPECT_EQ(identities(m.fds), sent[sf]) << "message " << sf << " got fds that were not its own";
    ++sf;
  }
  EXPECT_EQ(sf, kSf);
  EXPECT_TRUE(rx_rec.refusals.empty());
}

// A peer that does not announce kFlagFdBatches (an older Spindle) still gets
// one SF frame's fds per sendmsg: every batch of fds it receives is exactly
// one frame's.
TEST(FdBatches, APeerWithoutTheFlagGetsOneSfFramePerSendmsg) {
  FdRecorder rec;
  StreamHarness h;
  RawPeer peer;
  Stream* tx = h.make(peer.router_end, peer.router_end, &rec, {}, server_handshake());
  ASSERT_EQ(peer.handshake(kFlagFdPassing), 7u);
  ASSERT_FALSE(h.on([&] { return tx->peer_takes_fd_batches(); }));
  constexpr std::size_t kSf = 40;
  h.on([&] {
    for (std::size_t i = 0; i < kSf; ++i) {
      Message m = make_msg(static_cast<std::uint32_t>(1000 + i), "x");
      m.fds = FdSet(pipe_fds(i % 2 + 1));
      tx->enqueue(std::move(m), 0);
    }
    tx->flush();
  });
  std::size_t batches = 0, fds = 0;
  std::vector<std::size_t> sizes;
  std::vector<std::uint8_t> buf(1 << 16);
  while (fds < kSf / 2 * 3) {
    pollfd pf{peer.fd, POLLIN, 0};
    ASSERT_EQ(::poll(&pf, 1, 10000), 1) << "only " << fds << " fds came";
    FdControl control;
    iovec iov{buf.data(), buf.size()};
    msghdr mh{};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    control.receive_into(mh);
    ASSERT_GT(::recvmsg(peer.fd, &mh, MSG_CMSG_CLOEXEC), 0);
    std::size_t got = 0;
    FdControl::for_each_received(mh, [&](int fd) {
      ++got;
      ::close(fd);
    });
    if (got) {
      ++batches;
      sizes.push_back(got);
      fds += got;
    }
  }
  EXPECT_EQ(batches, kSf);
  for (std::size_t i = 0; i < sizes.size(); ++i) EXPECT_EQ(sizes[i], i % 2 + 1) << "batch " << i;
}

// A raw peer that announced batches sends `bytes` with `nfds` fds in one
// sendmsg to a stream that announced them too; returns why the stream
// closed ("" if it did not) and the messages it delivered.
struct Outcome {
  std::string closed;
  std::vector<Message> delivered;
};
Outcome send_batch(const std::vector<std::uint8_t>& bytes, std::vector<UniqueFd> fds) {
  FdRecorder rec;
  StreamHarness h;
  RawPeer peer;
  h.make(peer.router_end, peer.router_end, &rec, {}, server_handshake());
  EXPECT_EQ(peer.handshake(kFlagFdPassing | kFlagFdBatches), 7u);
  std::vector<int> raw;
  for (const UniqueFd& f : fds) raw.push_back(f.get());
  EXPECT_TRUE(send_with_fds(peer.fd, bytes, raw));
  Outcome o;
  o.closed = deliveries_before_end(peer.fd, rec, o.delivered);
  return o;
}

std::vector<std::uint8_t> concat(std::initializer_list<std::vector<std::uint8_t>> parts) {
  std::vector<std::uint8_t> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

TEST(FdBatches, AHandMadeBatchIsBoundByCount) {
  auto fds = pipe_fds(4);
  auto ids = identities(fds);
  Header plain;
  plain.dst_id = 1;
  plain.src_id = 2;
  plain.handle = 20;
  const std::string between = frame_bytes(plain, "between");
  // head: 1 fd of a batch of 4; a plain frame; then 3 fds for the next.
  Outcome o = send_batch(concat({sf_frame(10, 1, "a", kFdFlagBatchHead, 4),
                                 std::vector<std::uint8_t>(between.begin(), between.end()),
                                 sf_frame(11, 3, "b")}),
                         std::move(fds));
  EXPECT_EQ(o.closed, "");
  ASSERT_EQ(o.delivered.size(), 3u);
  EXPECT_EQ(identities(o.delivered[0].fds), (std::vector<std::pair<dev_t, ino_t>>{ids[0]}));
  EXPECT_TRUE(o.delivered[1].fds.empty());
  EXPECT_EQ(identities(o.delivered[2].fds),
            (std::vector<std::pair<dev_t, ino_t>>{ids[1], ids[2], ids[3]}));
}

TEST(FdBatches, EveryWayToGetABatchWrongIsAProtocolErrorThatSaysWhich) {
  struct Case {
    const char* what;
    std::vector<std::uint8_t> bytes;
    std::size_t fds;
    std::string error;
    std::size_t delivered = 0;  // frames before the bad one are delivered
  };
  // batch_fds set in a frame that is not a head (encode_fd_prefix would not).
  std::vector<std::uint8_t> stray = sf_frame(10, 1, "a");
  stray[kHeaderSize + 7] = 5;
  const std::vector<Case> cases = {
      {"fewer fds than the head says", sf_frame(10, 1, "a", kFdFlagBatchHead, 3), 2,
       "SF batch head declares 3 fds but 2 arrived"},
      {"a frame wants more than is left",
       concat({sf_frame(10, 1, "a", kFdFlagBatchHead, 2), sf_frame(11, 2, "b")}), 2,
       "SF frame declares 2 fds but its batch has 1 left", 1},
      {"a new head while fds are owed",
       concat({sf_frame(10, 1, "a", kFdFlagBatchHead, 3), sf_frame(11, 1, "b", kFdFlagBatchHead, 1)}), 3,
       "an fd batch began while 2 fds of the last were owed", 1},
      {"a head smaller than its own frame", sf_frame(10, 2, "a", kFdFlagBatchHead, 1), 2,
       "says its batch holds 1"},
      {"batch_fds outside a head", stray, 1, "batch_fds 0x0005"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    Outcome o = send_batch(c.bytes, pipe_fds(c.fds));
    EXPECT_NE(o.closed.find(c.error), std::string::npos) << o.closed;
    EXPECT_EQ(o.delivered.size(), c.delivered);
  }
}

// A stream that never announced batches (no handshake here) refuses a head.
TEST(FdBatches, AHeadToASideThatNeverAnnouncedBatchesIsAProtocolError) {
  FdRecorder rec;
  StreamHarness h;
  FdPair sp = make_socketpair();
  h.make(sp.a, sp.a, &rec);
  auto fds = pipe_fds(1);
  const int raw = fds[0].get();
  ASSERT_TRUE(send_with_fds(sp.b, sf_frame(10, 1, "a", kFdFlagBatchHead, 1), std::span<const int>(&raw, 1)));
  ASSERT_TRUE(rec.wait_closed());
  EXPECT_NE(rec.close_reason().find("unknown flags 0x0002"), std::string::npos) << rec.close_reason();
  EXPECT_EQ(rec.message_count(), 0u);
  h.teardown();
  close_fd(sp.b);
}

// MSG_CTRUNC in the middle of a batch: the receiver has 3 fds to spare and
// a batch of three frames brings 2 fds each. The kernel installs the first 3
// and drops the rest: the first frame is delivered with its 2, the second
// (1 of its 2 arrived) and the third (none arrived) are refused with the
// reason, and the connection goes on (PROTOCOL §13.4). Unbatched, the second
// would have lost 1 fd, then the third 1 (the second's went back first).
TEST(FdBatches, FdsDroppedFromTheTailOfABatchFailOnlyTheirOwnFrames) {
  constexpr std::uint32_t kFill = 4100, kSink = 4102, kTake = 4103;
  Broker broker;
  // A mark far above what is sent below: no send waits for the child.
  RouterOptions ro = root_opts();
  ro.high_water_mark = std::size_t{256} << 20;
  Router router(broker, ro);
  Context c = fork_child(router, [](ChildEnv& env) {
    Router& r = env.router();
    auto fillers = std::make_shared<std::vector<UniqueFd>>();
    // Uses up all fds but three, then holds the broker thread until the
    // parent writes to the pipe that came with the message: meanwhile the
    // parent queues everything below behind a socket nobody reads.
    r.add_handler([&r, fillers](Message&& m) {
      std::vector<UniqueFd> gate = m.fds.take_all();
      const int go = gate.at(0).get();
      for (UniqueFd& f : gate) fillers->push_back(std::move(f));
      use_up_fds_but(3, *fillers);
      char b;
      (void)!::read(go, &b, 1);
      r.reply(m, Payload::copy_of(std::string("full")));
    }, {}, kFill);
    r.add_handler([](Message&&) {}, {}, kSink);
    r.add_handler([&r](Message&& m) {
      r.reply(m, Payload::copy_of(std::to_string(m.fds.size()) + " fds"));
    }, {}, kTake);
    env.serve();
    return 0;
  }, named("fd-batch-starved"));
  FdPair gate = make_pipe();
  Message fill = Message::make(c.id(), kFill, {});
  std::vector<UniqueFd> gate_end;
  gate_end.emplace_back(gate.a);
  fill.fds = FdSet(std::move(gate_end));
  std::future<Message> filled = router.request(std::move(fill), 30s);
  // 36 MiB in plain messages (each under the memfd threshold): more than
  // the socket holds, so what follows waits in our queue.
  const std::string chunk(900 << 10, 'p');
  for (int i = 0; i < 40; ++i) router.send(Message::make(c.id(), kSink, Payload::copy_of(chunk)));
  // Three frames with 2 fds each, queued together: one batch of 6.
  std::vector<std::future<Message>> replies;
  for (int i = 0; i < 3; ++i) {
    Message m = Message::make(c.id(), kTake, Payload::copy_of(std::to_string(i)));
    m.fds = FdSet(pipe_fds(2));
    replies.push_back(router.request(std::move(m), 30s));
  }
  // The broker moves them from the outbox to the stream's queue at once;
  // then the child may read.
  std::this_thread::sleep_for(200ms);
  ASSERT_EQ(::write(gate.b, "x", 1), 1);
  close_fd(gate.b);
  EXPECT_EQ(filled.get().text(), "full");
  EXPECT_EQ(replies[0].get().text(), "2 fds");
  for (int i = 1; i < 3; ++i) {
    try {
      replies[static_cast<std::size_t>(i)].get();
      ADD_FAILURE() << "frame " << i << " was delivered without its fds";
    } catch (const ChannelError& e) {
      EXPECT_NE(std::string(e.what()).find(reason::kFdsLost), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(i == 1 ? "1 of 2 fds lost" : "2 of 2 fds lost"), std::string::npos)
          << e.what();
    }
  }
  // The connection survived: a message with fds to spare still goes through.
  Message again = Message::make(c.id(), kTake, {});
  again.fds = FdSet(pipe_fds(1));
  EXPECT_EQ(router.call(std::move(again), 10s).text(), "1 fds");
  c.shutdown();
  expect_exit_code(c, 0);
}

}  // namespace test_fd_batches
}  // namespace spindle
