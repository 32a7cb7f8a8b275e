// A Select is a LaneSet whose takers are the application's threads and whose
// lanes are receivers; get() is take() followed at once by done(), since the
// caller, not the set, runs the message. A Receiver's handler (broker thread)
// pushes into its lane, or answers with a dead reply once the Select closed.
#include "services/select.h"

#include <fmt/format.h>

#include "broker/errors.h"
#include "services/reasons.h"
#include "services/reply.h"

namespace spindle::services {

std::optional<Select::Event> Select::get(std::chrono::nanoseconds timeout) {
  auto now = LaneSet::Clock::now();
  auto deadline = timeout >= LaneSet::Clock::time_point::max() - now
                      ? LaneSet::Clock::time_point::max()
                      : now + std::chrono::duration_cast<LaneSet::Clock::duration>(timeout);
  auto t = lanes_.take(deadline);
  if (!t) return std::nullopt;
  lanes_.done(*t->lane);
  return Event{static_cast<Receiver*>(t->lane->owner), std::move(t->msg)};
}

void Select::close() {
  for (LaneSet::Taken& t : lanes_.close()) {
    auto* r = static_cast<Receiver*>(t.lane->owner);
    send_dead_reply(r->router(), t.msg, reason::kSelectClosed);
  }
}

Receiver::Receiver(Router& router, Select& select, std::uint32_t handle, HandlerOptions opts)
    : router_(router), select_(select), lane_(select.lanes_.add_lane(LaneOptions{})) {
  lane_.owner = this;
  handle_ = router_.add_handler(
      [this](Message&& m) {
        switch (select_.lanes_.push(lane_, m)) {
          case LaneSet::Push::kQueued: break;
          case LaneSet::Push::kClosed: send_dead_reply(router_, m, reason::kSelectClosed); break;
          case LaneSet::Push::kFull:
            send_dead_reply(router_, m, fmt::format("{}: receiver on handle {} holds {} messages at most",
                                                    reason::kQueueFull, handle_, lane_.max_messages()));
            break;
        }
      },
      std::move(opts), handle);
  if (handle_ == 0) throw Error(fmt::format("receiver: handle {} is already taken", handle));
  // A thread waiting in get() runs this broker's loop while no one else
  // does, so the message it brings needs no wake-up (lanes.h).
  select_.lanes_.join_loop(&router_.broker());
}

Receiver::~Receiver() {
  del_handler_on_broker(router_, handle_);
  for (Message& m : select_.lanes_.retire(lane_)) send_dead_reply(router_, m, reason::kSelectClosed);
  select_.lanes_.leave_loop();  // before the broker may go
}

}  // namespace spindle::services
