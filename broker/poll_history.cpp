// The record is a thread-local: `misses` windows in a row that ended
// unanswered, `skip` waits left to sleep at once, and `typical_ns`, a moving
// average of how long the thread's waits took to be answered (each new one
// weighs a quarter).
#include "broker/poll_history.h"

#include <cstdint>

#include "broker/broker.h"

namespace spindle::poll_history {
namespace {

struct Record {
  std::uint8_t misses = 0;
  std::uint8_t skip = 0;
  std::int64_t typical_ns = 0;
};
thread_local Record t_record;

}  // namespace

std::chrono::nanoseconds window(std::chrono::nanoseconds base) {
  if (base.count() <= 0) return std::chrono::nanoseconds::zero();
  if (t_record.skip > 0) {
    --t_record.skip;
    return std::chrono::nanoseconds::zero();
  }
  return Broker::spin_window(base, std::chrono::nanoseconds(t_record.typical_ns));
}

void polled(bool answered) {
  if (answered) {
    t_record.misses = 0;
  } else if (++t_record.misses >= kMissesToBackOff) {
    t_record.misses = kMissesToBackOff;  // the next probe that misses backs off again
    t_record.skip = kBackOffWaits;
  }
}

void answered_after(std::chrono::nanoseconds took) {
  std::int64_t& typical = t_record.typical_ns;
  typical = typical == 0 ? took.count() : typical + (took.count() - typical) / 4;
}

}  // namespace spindle::poll_history
