// SendBatch: this thread's one-way sends, handed to the broker together.
//
//   {
//     spindle::SendBatch batch(worker);              // any Context of the runtime
//     for (const auto& row : rows) worker.send(kRows, row);
//   }                                                // one wake-up, one write per stream
//
// Role: a send normally reaches the broker thread at once (written straight
// to an idle stream, or queued with a wake-up). A thread sending a burst
// outruns the broker, which wakes, writes what has come, sleeps and is woken
// again several times per burst: on a machine with more busy threads than
// CPUs each of those wake-ups is a context switch. While a SendBatch lives,
// this thread's one-way sends through its runtime (Context::send, and
// Sender<T>::send) are queued without a wake-up and never written on this
// thread; its end wakes the broker once, which writes each stream what the
// batch brought it in one writev.
//
// What does not change: order, charging and refusals are as without the
// batch; messages may leave earlier (another thread woke the broker), never
// out of order. Calls are not gathered: one made inside a batch goes at
// once, after what was sent before it. A send that must wait (destination
// over its high-water mark, send queue full) hands the batch over first, so a
// batch never waits on itself. Do not wait inside a batch for the answer to
// a message it sent: that message may not have left.
//
// Thread safety: belongs to the thread that made it; destroy it there, in
// reverse order of construction (batches nest). Ended on another thread (a
// coroutine resumed elsewhere), it still ends: the thread that made it stops
// gathering, and its broker is woken. Ownership: holds the runtime's link,
// not the runtime: a batch that outlives its runtime ends quietly.
#pragma once

#include <memory>

#include <spindle/context.h>

namespace spindle {

class SendBatch {
 public:
  // Gathers sends through `through`'s runtime (to any context).
  explicit SendBatch(const Context& through);
  ~SendBatch();
  SendBatch(const SendBatch&) = delete;
  SendBatch& operator=(const SendBatch&) = delete;

 private:
  std::shared_ptr<detail::RouterLink> link_;
  // This batch's mark on its thread, and the one it replaced (restored at
  // the end): Router::GatherMarks.
  std::shared_ptr<void> mine_, previous_;
};

}  // namespace spindle
