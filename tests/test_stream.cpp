// Stream: messages over socketpairs and pipe pairs, large bodies, gathered
// writes, draining, peer EOF, handshakes (timeout, hand-over, refusal),
// protocol errors, and write errors (EPIPE / ECONNRESET, no SIGPIPE death).
//
// Streams live on the broker thread: they are created, fed and inspected
// through StreamHarness::on() (a defer + wait). The far end is either the test
// thread with blocking reads/writes, or a second Stream on the same broker.
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "broker/broker.h"
#include "stream/handshake.h"
#include "stream/rx_buffer.h"
#include "stream/stream.h"
#include "stream_test_util.h"

namespace spindle {
namespace test_stream {

using namespace std::chrono_literals;
using testutil::close_fd;
using testutil::FdPair;
using testutil::frame_bytes;
using testutil::FrameReader;
using testutil::make_msg;
using testutil::make_pipe;
using testutil::make_socketpair;
using testutil::pattern;
using testutil::payload_bytes;
using testutil::Recorder;
using testutil::StreamHarness;
using testutil::write_all;

bool contains(const std::string& hay, const std::string& needle) {
  return hay.find(needle) != std::string::npos;
}

std::vector<std::uint8_t> concat(std::vector<std::uint8_t> a, const std::vector<std::uint8_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Sends kCount messages each way between the test thread (test_wfd/test_rfd)
// and stream `s`, checking headers, bodies, order and stats.
void exchange_both_ways(StreamHarness& h, Recorder& rec, Stream* s, int test_wfd, int test_rfd) {
  constexpr int kCount = 5;
  // far end -> stream
  for (int i = 0; i < kCount; ++i) {
    std::string body = i == 0 ? std::string() : "to-stream-" + std::to_string(i);
    ASSERT_TRUE(write_all(test_wfd, frame_bytes(1000 + i, body)));
  }
  ASSERT_TRUE(rec.wait_messages(kCount));
  {
    std::lock_guard lk(rec.mu);
    ASSERT_EQ(rec.messages.size(), static_cast<std::size_t>(kCount));
    for (int i = 0; i < kCount; ++i) {
      const Message& m = rec.messages[static_cast<std::size_t>(i)];
      std::string body = i == 0 ? std::string() : "to-stream-" + std::to_string(i);
      EXPECT_EQ(m.header.handle, static_cast<std::uint32_t>(1000 + i));
      EXPECT_EQ(m.header.enc, kEncRaw);
      EXPECT_EQ(m.header.dst_id, 1u);
      EXPECT_EQ(m.header.src_id, 2u);
      EXPECT_EQ(m.header.length, body.size());
      EXPECT_EQ(m.text(), body);
    }
  }
  // stream -> far end
  h.on([&] {
    for (int i = 0; i < kCount; ++i)
      s->enqueue(make_msg(2000 + i, "from-stream-" + std::to_string(i)), 0);
    s->flush();
  });
  FrameReader reader(test_rfd);
  for (int i = 0; i < kCount; ++i) {
    auto m = reader.next();
    ASSERT_TRUE(m.has_value()) << "frame " << i << " missing";
    EXPECT_EQ(m->header.handle, static_cast<std::uint32_t>(2000 + i));
    EXPECT_EQ(m->text(), "from-stream-" + std::to_string(i));
  }
  StreamStats st = h.on([&] { return s->stats(); });
  EXPECT_EQ(st.messages_in, static_cast<std::uint64_t>(kCount));
  EXPECT_EQ(st.messages_out, static_cast<std::uint64_t>(kCount));
  EXPECT_GT(st.bytes_in, 0u);
  EXPECT_GT(st.bytes_out, 0u);
  EXPECT_EQ(h.on([&] { return s->state(); }), StreamState::kOpen);
  EXPECT_EQ(rec.closed_count(), 0);
}

// ---------------------------------------------------------------------------
// Basic transport
// ---------------------------------------------------------------------------

TEST(StreamTransport, MessagesBothWaysOverSocketpair) {
  Recorder rec;
  StreamHarness h;
  FdPair sp = make_socketpair();
  Stream* s = h.make(sp.a, sp.a, &rec);
  exchange_both_ways(h, rec, s, sp.b, sp.b);
  h.teardown();
  close_fd(sp.b);
}

TEST(StreamTransport, MessagesBothWaysOverPipePair) {
  Recorder rec;
  StreamHarness h;
  FdPair in = make_pipe();   // test writes in.b, stream reads in.a
  FdPair out = make_pipe();  // stream writes out.b, test reads out.a
  Stream* s = h.make(in.a, out.b, &rec);
  exchange_both_ways(h, rec, s, in.b, out.a);
  h.teardown();
  close_fd(in.b);
  close_fd(out.a);
}

// On a broker's own thread, a buffer that has nothing unread and whose
// chunk nobody else holds gives the chunk back on let_go(): the next buffer
// read on that thread takes the same chunk, so idle connections hold no
// receive memory and busy ones take turns with a few warm chunks. A chunk a
// payload still holds, or one with unread bytes, stays where it is. Off an
// own thread (the test's) there is no pool and the chunk stays.
TEST(RxBufferPool, AnIdleBufferGivesItsChunkToTheNextBufferOnItsThread) {
  auto fill = [](RxBuffer& rx, std::size_t n) {
    auto space = rx.write_space();
    std::fill_n(space.data(), n, std::uint8_t{1});
    rx.commit(n);
    return space.data();
  };
  StreamHarness h;
  h.on([&] {
    RxBuffer a, b, c;
    const std::uint8_t* a_chunk = fill(a, 100);
    a.let_go(false);
    EXPECT_EQ(a.chunk_count(), 1u) << "100 bytes are unread";
    a.drop(100);
    a.let_go(false);
    EXPECT_EQ(a.chunk_count(), 0u);
    EXPECT_EQ(fill(b, 10), a_chunk) << "b reads into the chunk a let go";

    Payload kept = b.take(10);
    b.let_go(true);
    EXPECT_EQ(b.chunk_count(), 1u) << "a payload still holds b's chunk";
    EXPECT_NE(fill(c, 10), a_chunk);
    c.drop(10);
    c.let_go(false);
    EXPECT_EQ(kept.size(), 10u);
  });
  RxBuffer off;
  fill(off, 10);
  off.drop(10);
  off.let_go(false);
  EXPECT_EQ(off.chunk_count(), 1u) << "a thread that is no broker's own keeps its chunk";
  h.teardown();
}

// A buffer that waits for the rest of a frame (let_go(true), as a stream
// waiting on its peer) keeps that frame's bytes in a stash of their own,
// charged to the peer, and gives the chunk to the pool: a connection that
// leaves a frame unfinished no longer pins 128 KiB charged to nobody. The
// bytes read the same from the stash, go back to the start of a chunk for
// the next read, and the charge goes with them.
TEST(RxBufferPool, AFrameWaitingForItsRestKeepsItsBytesNotItsChunk) {
  StreamHarness h;
  h.on([&] {
    auto account = std::make_shared<Account>(1u << 20, nullptr);
    RxBuffer a, b;
    a.set_account(account);
    auto space = a.write_space();
    const std::uint8_t* a_chunk = space.data();
    for (std::size_t i = 0; i < 100; ++i) space[i] = static_cast<std::uint8_t>(i);
    a.commit(100);
    a.drop(40);  // a frame before it was handled; 60 bytes of the next arrived
    a.let_go(false);
    EXPECT_EQ(a.chunk_count(), 1u) << "unread bytes stay unless the buffer waits on its peer";
    a.let_go(true);
    EXPECT_EQ(a.chunk_count(), 0u);
    EXPECT_EQ(a.readable(), 60u);
    EXPECT_EQ(a.stashed(), 60u);
    EXPECT_EQ(account->held(), 60u) << "the stash is charged to the peer";
    std::uint8_t head[10];
    a.peek(head, sizeof head);
    EXPECT_EQ(head[0], 40);
    EXPECT_EQ(head[9], 49);
    std::size_t seen = 0;
    a.visit(20, 40, [&](const std::uint8_t* p, std::size_t n) {
      EXPECT_EQ(p[0], 60);
      seen += n;
    });
    EXPECT_EQ(seen, 40u);

    auto b_space = b.write_space();
    EXPECT_EQ(b_space.data(), a_chunk) << "b reads into the chunk a gave back";
    b.commit(1);
    b.drop(1);
    b.let_go(false);

    auto more = a.write_space();
    EXPECT_EQ(a.chunk_count(), 1u);
    EXPECT_EQ(a.stashed(), 0u);
    EXPECT_EQ(account->held(), 0u) << "the charge goes with the stash";
    more[0] = 100;
    a.commit(1);
    Payload frame = a.take(61);
    std::vector<std::uint8_t> got(61);
    frame.copy_to(got.data());
    for (std::size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], 40 + i) << i;
    frame = Payload();

    RxBuffer big;  // more unread than any frame that stays in the chunks
    auto big_space = big.write_space();
    big.commit(std::min(big_space.size(), kStashMax + 1));
    big.let_go(true);
    EXPECT_EQ(big.chunk_count(), 1u);
  });
  h.teardown();
}

// An idle connection holds no receive chunk once its messages are let go
// (RxBuffer::let_go, as the stream waits for input), so a router with many
// quiet clients holds no 128 KiB per client. While a message still holds
// the chunk, the chunk stays.
TEST(StreamTransport, AnIdleStreamHoldsNoReceiveChunk) {
  // Keeps messages until told to let them go as they arrive.
  struct Releaser : Recorder {
    bool keep = true;  // under mu
    std::size_t let_go = 0;
    void on_stream_message(Stream& s, Message&& m) override {
      if (std::lock_guard lk(mu); !keep) {
        ++let_go;
        cv.notify_all();
        return;
      }
      Recorder::on_stream_message(s, std::move(m));
    }
  } rec;
  StreamHarness h;
  FdPair sp = make_socketpair();
  Stream* s = h.make(sp.a, sp.a, &rec);
  ASSERT_TRUE(write_all(sp.b, frame_bytes(1000, "kept")));
  ASSERT_TRUE(rec.wait_messages(1));
  EXPECT_EQ(h.on([&] { return s->receive_chunks(); }), 1u) << "the kept message holds the chunk";
  h.on([&] {
    std::lock_guard lk(rec.mu);
    rec.keep = false;
    rec.messages.clear();
  });
  ASSERT_TRUE(write_all(sp.b, frame_bytes(1001, "let go")));
  ASSERT_TRUE(rec.wait([&] { return rec.let_go == 1; }));
  EXPECT_EQ(h.on([&] { return s->receive_chunks(); }), 0u);
  h.teardown();
  close_fd(sp.b);
}

// A stream that waits for the rest of a frame holds that frame's bytes,
// charged to the peer, and no chunk; the frame then arrives whole.
TEST(StreamTransport, AStreamWaitingForTheRestOfAFrameHoldsItsBytesNotAChunk) {
  Recorder rec;
  StreamHarness h;
  FdPair sp = make_socketpair();
  Stream* s = h.make(sp.a, sp.a, &rec);
  const std::string body(1000, 'x');
  const auto frame = frame_bytes(1000, body);
  const std::size_t part = kHeaderSize + 300;
  const std::size_t held_before = h.on([&] { return s->account()->held(); });
  ASSERT_TRUE(write_all(sp.b, std::vector<std::uint8_t>(frame.begin(), frame.begin() + part)));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (h.on([&] { return s->stats().bytes_in; }) < part && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_EQ(h.on([&] { return s->stats().bytes_in; }), part);
  EXPECT_EQ(h.on([&] { return s->receive_chunks(); }), 0u) << "the partial frame pins a chunk";
  EXPECT_EQ(h.on([&] { return s->account()->held(); }) - held_before, part)
      << "the partial frame's bytes are charged to the peer";
  ASSERT_TRUE(write_all(sp.b, std::vector<std::uint8_t>(frame.begin() + part, frame.end())));
  ASSERT_TRUE(rec.wait_messages(1));
  {
    std::lock_guard lk(rec.mu);
    EXPECT_EQ(rec.messages[0].header.handle, 1000u);
    EXPECT_EQ(rec.messages[0].text(), body);
  }
  EXPECT_EQ(h.on([&] { return s->account()->held(); }), held_before);
  h.teardown();
  close_fd(sp.b);
}

TEST(StreamTransport, TwoStreamsOnOneBrokerTalk) {
  Recorder ra, rb;
  StreamHarness h;
  FdPair sp = make_socketpair();
  Stream* a = h.make(sp.a, sp.a, &ra);
  Stream* b = h.make(sp.b, sp.b, &rb);
  h.on([&] {
    for (int i = 0; i < 100; ++i) a->enqueue(make_msg(i, "a->b " + std::to_string(i)), 0);
    a->flush();
    for (int i = 0; i < 100; ++i) b->enqueue(make_msg(i, "b->a " + std::to_string(i)), 0);
    b->flush();
  });
  ASSERT_TRUE(rb.wait_messages(100));
  ASSERT_TRUE(ra.wait_messages(100));
  std::scoped_lock lk(ra.mu, rb.mu);
  for (int i = 0; i < 100; ++i) {
    EXPECT_EQ(rb.messages[static_cast<std::size_t>(i)].text(), "a->b " + std::to_string(i));
    EXPECT_EQ(ra.messages[static_cast<std::size_t>(i)].text(), "b->a " + std::to_string(i));
  }
}

// ---------------------------------------------------------------------------
// Large messages (bigger than one 128 KiB receive chunk)
// ---------------------------------------------------------------------------

void large_messages(bool use_pipes) {
  const std::vector<std::size_t> sizes = {
      (128u << 10) + 1,       // spans two receive chunks
      kDirectBodyThreshold,   // first size read straight into its own buffer
      1u << 20,               // 1 MiB
      5u << 20,               // 5 MiB
  };
  Recorder rec;
  StreamHarness h;
  FdPair sp{}, in{}, out{};
  int test_w, test_r;
  Stream* s;
  if (use_pipes) {
    in = make_pipe();
    out = make_pipe();
    s = h.make(in.a, out.b, &rec);
    test_w = in.b;
    test_r = out.a;
  } else {
    sp = make_socketpair();
    s = h.make(sp.a, sp.a, &rec);
    test_w = test_r = sp.b;
  }

  // Inbound: the test thread writes while the broker reads.
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    auto body = pattern(sizes[i], static_cast<std::uint32_t>(i + 1));
    Header hd;
    hd.handle = static_cast<std::uint32_t>(5000 + i);
    ASSERT_TRUE(write_all(test_w, frame_bytes(hd, body.data(), body.size())));
  }
  ASSERT_TRUE(rec.wait_messages(sizes.size()));
  {
    std::lock_guard lk(rec.mu);
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const Message& m = rec.messages[i];
      EXPECT_EQ(m.header.handle, 5000 + i);
      ASSERT_EQ(m.data.size(), sizes[i]);
      EXPECT_TRUE(payload_bytes(m.data) == pattern(sizes[i], static_cast<std::uint32_t>(i + 1)))
          << "inbound body of " << sizes[i] << " bytes corrupted";
    }
  }

  // Outbound: all queued in one turn; the stream finishes on writability.
  h.on([&] {
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      auto body = pattern(sizes[i], static_cast<std::uint32_t>(100 + i));
      s->enqueue(Message::make(1, static_cast<std::uint32_t>(6000 + i),
                               Payload::copy_of(std::span<const std::uint8_t>(body))),
                 0);
    }
    s->flush();
  });
  FrameReader reader(test_r);
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    auto m = reader.next();
    ASSERT_TRUE(m.has_value()) << "outbound frame " << i << " missing";
    EXPECT_EQ(m->header.handle, 6000 + i);
    ASSERT_EQ(m->data.size(), sizes[i]);
    EXPECT_TRUE(payload_bytes(m->data) == pattern(sizes[i], static_cast<std::uint32_t>(100 + i)))
        << "outbound body of " << sizes[i] << " bytes corrupted";
  }
  EXPECT_EQ(rec.closed_count(), 0);
  h.teardown();
  close_fd(sp.b);
  close_fd(in.b);
  close_fd(out.a);
}

TEST(StreamLarge, MessagesLargerThanAChunkArriveIntactOverSocketpair) { large_messages(false); }
TEST(StreamLarge, MessagesLargerThanAChunkArriveIntactOverPipes) { large_messages(true); }

// ---------------------------------------------------------------------------
// Gathered writes
// ---------------------------------------------------------------------------

TEST(StreamWrite, ThousandSmallMessagesGatheredIntoFewWrites) {
  Recorder rec;
  StreamHarness h;
  FdPair sp = make_socketpair();
  Stream* s = h.make(sp.a, sp.a, &rec);
  constexpr int kN = 1000;
  h.on([&] {
    for (int i = 0; i < kN; ++i) s->enqueue(make_msg(static_cast<std::uint32_t>(i), "m" + std::to_string(i)), 0);
    s->flush();
  });
  FrameReader reader(sp.b);
  for (int i = 0; i < kN; ++i) {
    auto m = reader.next();
    ASSERT_TRUE(m.has_value()) << "frame " << i << " missing";
    ASSERT_EQ(m->header.handle, static_cast<std::uint32_t>(i)) << "out of order";
    ASSERT_EQ(m->text(), "m" + std::to_string(i));
  }
  StreamStats st = h.on([&] { return s->stats(); });
  EXPECT_EQ(st.messages_out, static_cast<std::uint64_t>(kN));
  EXPECT_LT(st.writes, 20u) << "1000 small frames took " << st.writes << " write syscalls";
  EXPECT_GE(st.writes, 1u);
  h.teardown();
  close_fd(sp.b);
}

// ---------------------------------------------------------------------------
// Draining with a full queue
// ---------------------------------------------------------------------------

constexpr int kDrainCount = 10000;

void read_all_then_eof(int fd) {
  FrameReader reader(fd);
  int got = 0;
  while (auto m = reader.next()) {
    if (m->header.handle != static_cast<std::uint32_t>(got)) {
      ADD_FAILURE() << "frame " << got << " has handle " << m->header.handle;
      return;
    }
    ++got;
  }
  EXPECT_TRUE(reader.eof()) << "stream ended with an error, errno " << reader.error();
  EXPECT_EQ(reader.partial_at_eof(), 0u) << "EOF in the middle of a frame";
  EXPECT_EQ(got, kDrainCount) << "the far end must read every queued frame, then EOF";
}

void queue_then_drain(bool use_pipes) {
  Recorder rec;
  StreamHarness h;
  FdPair sp{}, in{}, out{};
  Stream* s;
  int test_r, test_w;
  if (use_pipes) {
    in = make_pipe();
    out = make_pipe();
    s = h.make(in.a, out.b, &rec);
    test_r = out.a;
    test_w = in.b;
  } else {
    sp = make_socketpair();
    s = h.make(sp.a, sp.a, &rec);
    test_r = test_w = sp.b;
  }
  h.on([&] {
    for (int i = 0; i < kDrainCount; ++i)
      s->enqueue(make_msg(static_cast<std::uint32_t>(i), "payload-" + std::to_string(i)), 0);
    s->drain();
  });
  read_all_then_eof(test_r);
  // The stream said goodbye and now waits for ours.
  EXPECT_EQ(h.on([&] { return s->state(); }), StreamState::kDraining);
  EXPECT_EQ(rec.closed_count(), 0);
  if (use_pipes) close_fd(in.b);
  else ::shutdown(test_w, SHUT_WR);
  ASSERT_TRUE(rec.wait_closed());
  {
    std::lock_guard lk(rec.mu);
    EXPECT_EQ(rec.closed, 1);
    EXPECT_FALSE(rec.reason.empty());
    EXPECT_TRUE(rec.unsent.empty()) << rec.unsent.size() << " messages reported unsent";
  }
  EXPECT_EQ(h.on([&] { return s->stats().messages_out; }), static_cast<std::uint64_t>(kDrainCount));
  h.teardown();
  close_fd(sp.b);
  close_fd(out.a);
}

TEST(StreamDrain, TenThousandQueuedThenDrainSocketpair) { queue_then_drain(false); }
TEST(StreamDrain, TenThousandQueuedThenDrainPipes) { queue_then_drain(true); }

// Drains its stream when the broker shuts down; reports drained once closed.
class StreamDrainer : public ShutdownParticipant {
 public:
  explicit StreamDrainer(Broker& b) : broker(b) {}
  void on_shutdown_begin() override {
    ++begins;
    stream->drain();
  }
  void on_shutdown_deadline() override {
    ++deadlines;
    stream->close("grace period over");
  }
  Broker& broker;
  Stream* stream = nullptr;
  std::atomic<int> begins{0}, deadlines{0};
};

TEST(StreamDrain, BrokerShutdownWithTenThousandQueued) {
  Recorder rec;
  StreamHarness h;
  FdPair sp = make_socketpair();
  Stream* s = h.make(sp.a, sp.a, &rec);
  StreamDrainer drainer(h.broker());
  drainer.stream = s;
  rec.on_closed = [&] { h.broker().participant_drained(&drainer); };
  h.on([&] { h.broker().add_participant(&drainer); });

  h.on([&] {
    for (int i = 0; i < kDrainCount; ++i)
      s->enqueue(make_msg(static_cast<std::uint32_t>(i), "payload-" + std::to_string(i)), 0);
    h.broker().shutdown(std::chrono::milliseconds(30000));
  });
  read_all_then_eof(sp.b);
  ::shutdown(sp.b, SHUT_WR);  // our goodbye
  testutil::join_bounded(h.broker());
  EXPECT_EQ(drainer.begins.load(), 1);
  EXPECT_EQ(drainer.deadlines.load(), 0);
  EXPECT_EQ(rec.closed_count(), 1);
  {
    std::lock_guard lk(rec.mu);
    EXPECT_TRUE(rec.unsent.empty());
  }
  h.teardown();
  close_fd(sp.b);
}

// ---------------------------------------------------------------------------
// Peer EOF
// ---------------------------------------------------------------------------

TEST(StreamEof, PeerCloseClosesOnceWithReason) {
  Recorder rec;
  StreamHarness h;
  FdPair sp = make_socketpair();
  Stream* s = h.make(sp.a, sp.a, &rec);
  ASSERT_TRUE(write_all(sp.b, frame_bytes(7, "last words")));
  close_fd(sp.b);
  ASSERT_TRUE(rec.wait_closed());
  testutil::settle(h.broker());
  std::lock_guard lk(rec.mu);
  EXPECT_EQ(rec.closed, 1) << "on_stream_closed must fire exactly once";
  // Any non-empty reason: today the library says "drained" here (its own
  // "peer closed the connection" in Stream::on_eof() is unreachable when the
  // queue is empty, because flush() closes first).
  EXPECT_FALSE(rec.reason.empty());
  EXPECT_EQ(rec.state_at_close, StreamState::kClosed);
  ASSERT_EQ(rec.messages.size(), 1u) << "the frame sent before EOF must still be delivered";
  EXPECT_EQ(rec.messages[0].text(), "last words");
  (void)s;
}

TEST(StreamEof, PeerCloseOnPipePair) {
  Recorder rec;
  StreamHarness h;
  FdPair in = make_pipe(), out = make_pipe();
  h.make(in.a, out.b, &rec);
  close_fd(in.b);
  ASSERT_TRUE(rec.wait_closed());
  testutil::settle(h.broker());
  EXPECT_EQ(rec.closed_count(), 1);
  EXPECT_FALSE(rec.close_reason().empty());
  // Our side sees the stream's goodbye too.
  std::uint8_t b;
  EXPECT_EQ(testutil::read_some(out.a, &b, 1), 0);
  h.teardown();
  close_fd(out.a);
}

void expect_partial_frame_close(const std::vector<std::uint8_t>& bytes, const char* what) {
  SCOPED_TRACE(what);
  Recorder rec;
  StreamHarness h;
  FdPair sp = make_socketpair();
  h.make(sp.a, sp.a, &rec);
  ASSERT_TRUE(write_all(sp.b, bytes));
  close_fd(sp.b);
  ASSERT_TRUE(rec.wait_closed());
  testutil::settle(h.broker());
  std::lock_guard lk(rec.mu);
  EXPECT_EQ(rec.closed, 1);
  EXPECT_TRUE(contains(rec.reason, "partial frame")) << "reason: " << rec.reason;
  EXPECT_TRUE(rec.messages.empty());
}

TEST(StreamEof, PeerClosedMidHeaderReportsPartialFrame) {
  auto f = frame_bytes(9, "hello");
  f.resize(10);
  expect_partial_frame_close(f, "mid-header");
}

TEST(StreamEof, PeerClosedMidBodyReportsPartialFrame) {
  Header hd;
  hd.handle = 9;
  auto body = pattern(100, 3);
  auto f = frame_bytes(hd, body.data(), body.size());
  f.resize(kHeaderSize + 10);
  expect_partial_frame_close(f, "mid-body");
}

TEST(StreamEof, PeerClosedMidLargeBodyReportsPartialFrame) {
  Header hd;
  hd.handle = 9;
  auto body = pattern(1u << 20, 4);
  auto f = frame_bytes(hd, body.data(), body.size());
  f.resize(kHeaderSize + (300u << 10));  // direct-body path
  expect_partial_frame_close(f, "mid-large-body");
}

// ---------------------------------------------------------------------------
// Handshakes
// ---------------------------------------------------------------------------

std::unique_ptr<Handshake> server_hs(std::uint32_t assign_id = 42) {
  return std::make_unique<ServerHandshake>(
      1, static_cast<std::uint32_t>(::getpid()), kDefaultMaxMessageSize,
      [assign_id](const PeerInfo&) -> ServerHandshake::Assignment { return assign_id; });
}

TEST(StreamHandshake, TimeoutClosesSilentPeerWithoutStallingOthers) {
  Recorder silent_short, silent_long, busy;
  StreamHarness h;
  FdPair a = make_socketpair(), a2 = make_socketpair(), b = make_socketpair();

  StreamOptions short_opts;
  short_opts.name = "silent-200ms";
  short_opts.handshake_timeout = 200ms;
  StreamOptions long_opts;
  long_opts.name = "silent-forever";
  long_opts.handshake_timeout = 60s;

  const auto t0 = std::chrono::steady_clock::now();
  h.make(a.a, a.a, &silent_short, short_opts, server_hs());
  Stream* s_long = h.make(a2.a, a2.a, &silent_long, long_opts, server_hs());
  Stream* s_busy = h.make(b.a, b.a, &busy);

  // While two peers say nothing, a third stream still gets its traffic.
  ASSERT_TRUE(write_all(b.b, frame_bytes(1, "while others are silent")));
  ASSERT_TRUE(busy.wait_messages(1));
  EXPECT_EQ(h.on([&] { return s_long->state(); }), StreamState::kHandshaking);

  ASSERT_TRUE(silent_short.wait_closed());
  const auto elapsed = std::chrono::steady_clock::now() - t0;
  {
    std::lock_guard lk(silent_short.mu);
    EXPECT_TRUE(contains(silent_short.reason, "timed out")) << silent_short.reason;
    EXPECT_EQ(silent_short.opened, 0);
    EXPECT_EQ(silent_short.closed, 1);
  }
  EXPECT_GE(elapsed, 190ms);
  std::uint8_t byte;
  EXPECT_EQ(testutil::read_some(a.b, &byte, 1), 0) << "timed-out stream must close its fd";

  // Still unaffected afterwards, both directions.
  ASSERT_TRUE(write_all(b.b, frame_bytes(2, "after the timeout")));
  ASSERT_TRUE(busy.wait_messages(2));
  h.on([&] {
    s_busy->enqueue(make_msg(3, "reply"), 0);
    s_busy->flush();
  });
  FrameReader reader(b.b);
  auto m = reader.next();
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->text(), "reply");
  EXPECT_EQ(busy.closed_count(), 0);
  EXPECT_EQ(silent_long.closed_count(), 0);
  EXPECT_EQ(h.on([&] { return s_long->state(); }), StreamState::kHandshaking);

  h.teardown();
  close_fd(a.b);
  close_fd(a2.b);
  close_fd(b.b);
}

TEST(StreamHandshake, ServerHandsOverFrameSentWithHello) {
  Recorder rec;
  StreamHarness h;
  FdPair sp = make_socketpair();
  std::uint32_t seen_pid = 0;
  auto hs = std::make_unique<ServerHandshake>(
      1, static_cast<std::uint32_t>(::getpid()), kDefaultMaxMessageSize,
      [&](const PeerInfo& hello) -> ServerHandshake::Assignment {
        seen_pid = hello.pid;
        return std::uint32_t{42};
      });
  int opened_at_first_message = -1;
  rec.on_message = [&](const Message&) {
    if (opened_at_first_message < 0) opened_at_first_message = rec.opened;
  };
  Stream* s = h.make(sp.a, sp.a, &rec, {}, std::move(hs));
  // Queued while handshaking: must be held back until after the welcome.
  h.on([&] {
    s->enqueue(make_msg(77, "held until open"), 0);
    s->flush();
  });

  // Hello and the first frame in ONE write.
  auto bytes = concat(encode_hello(kProtocolVersion, kFlagNone, 4242),
                      frame_bytes(1001, "rides with the hello"));
  ASSERT_EQ(::send(sp.b, bytes.data(), bytes.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(bytes.size()));

  ASSERT_TRUE(rec.wait_messages(1));
  {
    std::lock_guard lk(rec.mu);
    EXPECT_EQ(rec.opened, 1);
    EXPECT_EQ(opened_at_first_message, 1) << "message delivered before on_stream_open";
    EXPECT_EQ(rec.messages[0].header.handle, 1001u);
    EXPECT_EQ(rec.messages[0].text(), "rides with the hello");
    EXPECT_EQ(rec.peer_at_open.pid, 4242u);
    EXPECT_EQ(rec.peer_at_open.remote_id, 42u);
    EXPECT_EQ(rec.peer_at_open.local_id, 1u);
  }
  EXPECT_EQ(seen_pid, 4242u);
  EXPECT_TRUE(h.on([&] { return s->is_open(); }));

  // The welcome, then the held message.
  std::vector<std::uint8_t> welcome(kWelcomeSize);
  ASSERT_TRUE(testutil::read_exact(sp.b, welcome.data(), welcome.size()));
  // On a socket the server announces that it takes fds, in batches too.
  EXPECT_EQ(welcome, encode_welcome(kFlagFdPassing | kFlagFdBatches | kFlagMemfdRanges, 42, 1,
                                    static_cast<std::uint32_t>(::getpid()), kDefaultMaxMessageSize));
  FrameReader reader(sp.b);
  auto m = reader.next();
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->header.handle, 77u);
  EXPECT_EQ(m->text(), "held until open");
  h.teardown();
  close_fd(sp.b);
}

TEST(StreamHandshake, ClientHandsOverFrameSentWithWelcome) {
  Recorder rec;
  StreamHarness h;
  FdPair sp = make_socketpair();
  h.make(sp.a, sp.a, &rec, {}, std::make_unique<ClientHandshake>(777));
  std::vector<std::uint8_t> hello(kHelloSize);
  ASSERT_TRUE(testutil::read_exact(sp.b, hello.data(), hello.size()));
  EXPECT_EQ(hello, encode_hello(kProtocolVersion, kFlagFdPassing | kFlagFdBatches | kFlagMemfdRanges, 777));

  auto bytes = concat(encode_welcome(kFlagNone, 9, 3, 555, 1u << 20),
                      frame_bytes(2002, "rides with the welcome"));
  ASSERT_EQ(::send(sp.b, bytes.data(), bytes.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(bytes.size()));
  ASSERT_TRUE(rec.wait_messages(1));
  std::lock_guard lk(rec.mu);
  EXPECT_EQ(rec.opened, 1);
  EXPECT_EQ(rec.messages[0].text(), "rides with the welcome");
  EXPECT_EQ(rec.peer_at_open.local_id, 9u);
  EXPECT_EQ(rec.peer_at_open.remote_id, 3u);
  EXPECT_EQ(rec.peer_at_open.pid, 555u);
  EXPECT_EQ(rec.peer_at_open.max_message_size, 1u << 20);
  close_fd(sp.b);
}

TEST(StreamHandshake, ClientAndServerStreamsOnOneBroker) {
  Recorder rc, rs;
  StreamHarness h;
  FdPair sp = make_socketpair();
  Stream* server = h.make(sp.a, sp.a, &rs, {}, server_hs(42), /*start=*/false);
  Stream* client = h.make(sp.b, sp.b, &rc, {}, std::make_unique<ClientHandshake>(1234), false);
  h.on([&] {
    client->enqueue(make_msg(10, "queued before the handshake"), 0);
    server->start();
    client->start();
  });
  ASSERT_TRUE(rs.wait_messages(1));
  {
    std::lock_guard lk(rs.mu);
    EXPECT_EQ(rs.messages[0].text(), "queued before the handshake");
    EXPECT_EQ(rs.peer_at_open.pid, 1234u);
    EXPECT_EQ(rs.peer_at_open.remote_id, 42u);
  }
  h.on([&] {
    server->enqueue(make_msg(11, "hello client"), 0);
    server->flush();
  });
  ASSERT_TRUE(rc.wait_messages(1));
  std::lock_guard lk(rc.mu);
  EXPECT_EQ(rc.messages[0].text(), "hello client");
  EXPECT_EQ(rc.opened, 1);
  EXPECT_EQ(rc.peer_at_open.local_id, 42u);
  EXPECT_EQ(rc.peer_at_open.remote_id, 1u);
  EXPECT_EQ(rc.peer_at_open.pid, static_cast<std::uint32_t>(::getpid()));
}

TEST(StreamHandshake, RefusalClosesBothSidesWithTheReason) {
  Recorder rc, rs;
  StreamHarness h;
  FdPair sp = make_socketpair();
  auto refuse = std::make_unique<ServerHandshake>(
      1, 1, kDefaultMaxMessageSize,
      [](const PeerInfo&) -> ServerHandshake::Assignment { return std::string("no room at the inn"); });
  h.make(sp.a, sp.a, &rs, {}, std::move(refuse));
  h.make(sp.b, sp.b, &rc, {}, std::make_unique<ClientHandshake>(99));
  ASSERT_TRUE(rc.wait_closed());
  ASSERT_TRUE(rs.wait_closed());
  EXPECT_TRUE(contains(rc.close_reason(), "no room at the inn")) << rc.close_reason();
  EXPECT_TRUE(contains(rs.close_reason(), "no room at the inn")) << rs.close_reason();
  EXPECT_EQ(rc.opened, 0);
  EXPECT_EQ(rs.opened, 0);
}

TEST(StreamHandshake, BadHelloMagicIsRefused) {
  Recorder rec;
  StreamHarness h;
  FdPair sp = make_socketpair();
  h.make(sp.a, sp.a, &rec, {}, server_hs());
  const std::string junk = "GET / HTTP/1.1\r\n\r\n";
  ASSERT_TRUE(write_all(sp.b, reinterpret_cast<const std::uint8_t*>(junk.data()), junk.size()));
  ASSERT_TRUE(rec.wait_closed());
  EXPECT_TRUE(contains(rec.close_reason(), "magic")) << rec.close_reason();
  // The refusal explains itself before the EOF.
  std::uint8_t head[6];
  ASSERT_TRUE(testutil::read_exact(sp.b, head, sizeof head));
  EXPECT_EQ(std::string(reinterpret_cast<char*>(head), 4), "SPNO");
  close_fd(sp.b);
}

// ---------------------------------------------------------------------------
// Invalid input
// ---------------------------------------------------------------------------

TEST(StreamInvalid, BadMagicFrameCallsInvalidAndCloses) {
  Recorder rec;
  StreamHarness h;
  FdPair sp = make_socketpair();
  h.make(sp.a, sp.a, &rec);
  auto bytes = concat(frame_bytes(1, "good"), frame_bytes(2, "bad", /*enc=*/0x1234));
  ASSERT_TRUE(write_all(sp.b, bytes));
  ASSERT_TRUE(rec.wait_closed());
  testutil::settle(h.broker());
  {
    std::lock_guard lk(rec.mu);
    EXPECT_EQ(rec.invalid, 1);
    EXPECT_TRUE(contains(rec.invalid_error, "magic")) << rec.invalid_error;
    EXPECT_EQ(rec.closed, 1);
    EXPECT_TRUE(contains(rec.reason, "magic")) << rec.reason;
    ASSERT_EQ(rec.messages.size(), 1u) << "the good frame before the bad one must be delivered";
    EXPECT_EQ(rec.messages[0].text(), "good");
  }
  std::uint8_t b;
  EXPECT_EQ(testutil::read_some(sp.b, &b, 1), 0) << "stream must close its fd";
  close_fd(sp.b);
}

TEST(StreamInvalid, OversizedFrameIsRejectedFromTheHeader) {
  Recorder rec;
  StreamHarness h;
  FdPair sp = make_socketpair();
  StreamOptions o;
  o.max_message_size = 1024;
  h.make(sp.a, sp.a, &rec, o);
  Header hd;
  hd.length = 4096;
  auto hb = encode_header(hd);
  // Only the header: the stream must not wait for a body it will refuse.
  ASSERT_TRUE(write_all(sp.b, hb.data(), hb.size()));
  ASSERT_TRUE(rec.wait_closed());
  std::lock_guard lk(rec.mu);
  EXPECT_EQ(rec.invalid, 1);
  EXPECT_TRUE(contains(rec.reason, "too large")) << rec.reason;
  close_fd(sp.b);
}

// ---------------------------------------------------------------------------
// Write errors: EPIPE / ECONNRESET
// ---------------------------------------------------------------------------

bool sigpipe_pending_on_broker(StreamHarness& h) {
  return h.on([] {
    sigset_t set;
    sigemptyset(&set);
    ::sigpending(&set);
    return sigismember(&set, SIGPIPE) == 1;
  });
}

TEST(StreamWriteError, WriteToClosedSocketPeerClosesWithReason) {
  Recorder rec;
  StreamHarness h;
  FdPair sp = make_socketpair();
  Stream* s = h.make(sp.a, sp.a, &rec);
  const std::size_t n = 64;
  h.on([&] {
    // Close the far end and write in the same broker turn, so the write (not
    // the read side's EOF) is what discovers it.
    ::close(sp.b);
    EXPECT_TRUE(s->gauge().try_acquire(n));
    s->enqueue(make_msg(31, std::string(n, 'x')), n);
    s->flush();
  });
  sp.b = -1;
  ASSERT_TRUE(rec.wait_closed());
  testutil::settle(h.broker());
  {
    std::lock_guard lk(rec.mu);
    EXPECT_EQ(rec.closed, 1);
    EXPECT_FALSE(rec.reason.empty());
    EXPECT_TRUE(contains(rec.reason, "peer closed")) << rec.reason;
    ASSERT_EQ(rec.unsent.size(), 1u) << "the undelivered message must be reported unsent";
    EXPECT_EQ(rec.unsent[0].header.handle, 31u);
  }
  EXPECT_EQ(h.on([&] { return s->gauge().queued(); }), 0u) << "charged bytes not released";
  EXPECT_TRUE(h.on([&] { return s->gauge().closed(); }));
  EXPECT_FALSE(sigpipe_pending_on_broker(h));
}

TEST(StreamWriteError, PeerClosesWithUnreadDataConnectionReset) {
  Recorder rec;
  StreamHarness h;
  FdPair sp = make_socketpair();
  Stream* s = h.make(sp.a, sp.a, &rec);
  // Put data in the far end's receive queue, then close it unread: the
  // kernel resets the connection.
  h.on([&] {
    s->enqueue(make_msg(1, "never read"), 0);
    s->flush();
  });
  close_fd(sp.b);
  ASSERT_TRUE(rec.wait_closed());
  EXPECT_FALSE(rec.close_reason().empty());
  // Writing afterwards is a harmless no-op on a closed stream.
  h.on([&] {
    s->enqueue(make_msg(2, "after close"), 0);
    s->flush();
  });
  testutil::settle(h.broker());
  EXPECT_EQ(rec.closed_count(), 1);
}

TEST(StreamWriteError, WriteToClosedPipeNoSigpipeDeath) {
  Recorder rec;
  StreamHarness h;
  FdPair in = make_pipe(), out = make_pipe();
  Stream* s = h.make(in.a, out.b, &rec);
  close_fd(out.a);  // nobody reads the stream's output any more
  const std::size_t n = 128;
  h.on([&] {
    EXPECT_TRUE(s->gauge().try_acquire(n));
    s->enqueue(make_msg(41, std::string(n, 'y')), n);
    s->flush();
  });
  ASSERT_TRUE(rec.wait_closed());
  testutil::settle(h.broker());
  {
    std::lock_guard lk(rec.mu);
    EXPECT_EQ(rec.closed, 1);
    EXPECT_FALSE(rec.reason.empty());
    ASSERT_EQ(rec.unsent.size(), 1u);
    EXPECT_EQ(rec.unsent[0].header.handle, 41u);
  }
  EXPECT_FALSE(sigpipe_pending_on_broker(h)) << "a SIGPIPE was left pending on the broker thread";
  EXPECT_EQ(h.on([&] { return s->gauge().queued(); }), 0u);
  h.teardown();
  close_fd(in.b);
}

TEST(StreamWriteError, LargeWriteToPipeClosedMidWay) {
  // The reader goes away while a multi-megabyte message is half written.
  Recorder rec;
  StreamHarness h;
  FdPair in = make_pipe(), out = make_pipe();
  Stream* s = h.make(in.a, out.b, &rec);
  auto body = pattern(4u << 20, 9);
  h.on([&] {
    s->enqueue(Message::make(1, 1, Payload::copy_of(std::span<const std::uint8_t>(body))), 0);
    s->flush();
  });
  std::vector<std::uint8_t> some(4096);
  ASSERT_TRUE(testutil::read_exact(out.a, some.data(), some.size()));
  close_fd(out.a);
  ASSERT_TRUE(rec.wait_closed());
  testutil::settle(h.broker());
  EXPECT_EQ(rec.closed_count(), 1);
  EXPECT_FALSE(rec.close_reason().empty());
  EXPECT_FALSE(sigpipe_pending_on_broker(h));
  h.teardown();
  close_fd(in.b);
}

}  // namespace test_stream
}  // namespace spindle
