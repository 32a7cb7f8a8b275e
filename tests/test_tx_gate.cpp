// TxGate (stream/port.h): who may write a stream's fd, step by step.
//
// The case that matters most: an application thread's direct write that the
// socket took only part of. Its rest goes to the broker in a posted task.
// Until that task runs nobody else may write (the rest must go first), but
// no thread holds the fd any more either: a stream closed meanwhile closes
// its fd at once, and its destructor, which waits while a writer holds the
// fd, must not wait for a task that may never run. Before kRest the writer
// kept kUser until the task ran, so a stream destroyed on the broker thread
// with that task still queued behind it spun for ever.
#include <gtest/gtest.h>

#include "stream/port.h"

namespace spindle {
namespace test_tx_gate {

// A gate as an open, idle stream has it: its handshake done, nothing queued.
void open(TxGate& g) {
  g.clear_busy();
  g.allow_direct();
}

TEST(TxGate, APartialDirectWriteLetsGoOfTheFdButKeepsOthersOut) {
  TxGate g;
  open(g);
  ASSERT_TRUE(g.try_acquire_direct());
  EXPECT_FALSE(g.broker_may_write()) << "the broker wrote while a user held the fd";

  g.hand_over_rest();
  EXPECT_FALSE(g.load() & TxGate::kUser) << "the writer still holds the fd after handing over";
  EXPECT_FALSE(g.broker_may_write()) << "the broker could write ahead of the rest";
  EXPECT_FALSE(g.try_acquire_direct()) << "another user could write ahead of the rest";

  g.clear_rest();  // the broker took the rest over
  EXPECT_TRUE(g.broker_may_write());
}

TEST(TxGate, AStreamClosedWhileARestIsOnItsWayClosesItsFdAtOnce) {
  TxGate g;
  open(g);
  ASSERT_TRUE(g.try_acquire_direct());
  g.hand_over_rest();
  // close() says whether a user holds the fd (then the broker must wait for
  // its kick): here nobody does.
  EXPECT_FALSE(g.close());
  EXPECT_FALSE(g.load() & TxGate::kUser);  // what ~Stream waits on
  EXPECT_FALSE(g.try_acquire_direct());
}

TEST(TxGate, AUserWritingNowHoldsTheFdAcrossAClose) {
  TxGate g;
  open(g);
  ASSERT_TRUE(g.try_acquire_direct());
  EXPECT_TRUE(g.close()) << "the fd could be closed under a writer in sendmsg";
  // Its frame was written whole: it gives the fd back and must kick the
  // broker, which then closes the fd.
  EXPECT_EQ(g.release_direct() & TxGate::kClosed, TxGate::kClosed);
  EXPECT_FALSE(g.load() & TxGate::kUser);
}

TEST(TxGate, FramesTheBrokerQueuedDuringAPartialWriteWaitForTheRest) {
  TxGate g;
  open(g);
  ASSERT_TRUE(g.try_acquire_direct());
  g.mark_queued();  // the broker queued a frame meanwhile
  g.hand_over_rest();
  EXPECT_FALSE(g.broker_may_write());
  EXPECT_TRUE(g.load() & TxGate::kPending);
  g.clear_rest();
  EXPECT_TRUE(g.broker_may_write());
  EXPECT_TRUE(g.load() & TxGate::kBusy) << "its queue is not empty: no direct write may jump it";
  EXPECT_FALSE(g.try_acquire_direct());
}

}  // namespace test_tx_gate
}  // namespace spindle
