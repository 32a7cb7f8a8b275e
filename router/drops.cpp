// What cannot be answered (a message without reply_to that cannot be
// delivered, a dead reply whose sender has gone) is counted, never written to
// the log one line per message: a peer that makes us drop half a million
// messages must not make us write half a million lines. One summary line per
// kind per second at most, naming the last one.
#include <algorithm>

#include <fmt/format.h>

#include "broker/log.h"
#include "router/router.h"

namespace spindle {

void Router::note_undeliverable(const Header& h, const std::string& why) {
  auto now = Clock::now();
  ++drops_.count;
  drops_.last = fmt::format("{} from context {} to context {} handle {}: {}",
                            h.is_dead() ? "dead reply" : "message", h.src_id, h.dst_id, h.handle,
                            why);
  if (now - drops_.logged_at < std::chrono::seconds(1)) return;
  log().warn("dropped {} undeliverable message(s) with nowhere to send a reply; the last: {}",
             drops_.count, drops_.last);
  drops_.count = 0;
  drops_.logged_at = now;
}

void Router::note_wrong_sender(const std::string& why) {
  auto now = Clock::now();
  ++wrong_senders_.count;
  wrong_senders_.last = why;
  if (now - wrong_senders_.logged_at < std::chrono::seconds(1)) return;
  log().warn("ignored {} reply(ies) to pending calls from contexts other than the callee; the last: {}",
             wrong_senders_.count, wrong_senders_.last);
  wrong_senders_.count = 0;
  wrong_senders_.logged_at = now;
}

bool Router::refusal_due(Link& in) {
  ++in.refusals;
  return Clock::now() - in.refusal_logged_at >= std::chrono::seconds(1);
}

void Router::log_refusal(Link& in, std::string_view kind, const std::string& why) {
  log().warn("stream={} {} refusal(s) ({}); the last: {}", in.stream->name(), in.refusals, kind, why);
  in.refusals = 0;
  in.refusal_logged_at = Clock::now();
}

}  // namespace spindle

namespace spindle {

bool LogBudget::take(std::chrono::steady_clock::time_point now, double rate, double burst) {
  if (tokens_ < 0) tokens_ = burst;
  else tokens_ = std::min(burst, tokens_ + rate * std::chrono::duration<double>(now - last_).count());
  last_ = now;
  if (tokens_ >= 1) {
    tokens_ -= 1;
    return true;
  }
  ++suppressed_;
  return false;
}

std::chrono::milliseconds LogBudget::refill_time(double rate) const {
  if (rate <= 0) return std::chrono::milliseconds(1000);
  const double missing = std::max(0.0, 1.0 - tokens_);
  return std::chrono::milliseconds(1 + static_cast<long>(missing / rate * 1000));
}

std::uint64_t LogBudget::take_suppressed(std::chrono::steady_clock::time_point now) {
  if (suppressed_ == 0 || now - reported_at_ < std::chrono::seconds(1)) return 0;
  reported_at_ = now;
  return std::exchange(suppressed_, 0);
}

}  // namespace spindle
