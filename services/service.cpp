// Deduplication keys a call by method and argument bytes. The first call of a
// key registers its reply state and computes; an identical call that arrives
// while that state is unanswered joins it (ReplyState::join) and returns at
// once, its worker free again. The state forgets the key as it answers, so a
// call arriving after the answer computes afresh: results are shared, never
// cached. The key is a hash of the method, the arguments' size and their
// first and last 4 KiB, and the arguments themselves are compared on a
// match: the table never copies them (it copied all of them into its key,
// twice, uncharged: 256 MiB held for a 128 MiB call).
#include "services/service.h"

#include <algorithm>
#include <array>
#include <cstring>

#include <fmt/format.h>

#include "broker/errors.h"
#include "broker/log.h"
#include "broker/summary_log.h"
#include "services/envelope.h"
#include "services/reasons.h"

namespace spindle::services {
namespace {

// `n` bytes of `p` from `offset` into `out`, across its slices.
void copy_range(const Payload& p, std::size_t offset, std::size_t n, std::uint8_t* out) {
  for (const Slice& s : p.slices()) {
    if (n == 0) return;
    if (offset >= s.size) {
      offset -= s.size;
      continue;
    }
    const std::size_t k = std::min(n, s.size - offset);
    std::memcpy(out, s.data + offset, k);
    out += k, n -= k, offset = 0;
  }
}

std::uint64_t dedup_key(std::string_view method, const Payload& args) {
  constexpr std::size_t kEdge = 4096;
  std::array<std::uint8_t, 2 * kEdge> edges{};
  const std::size_t head = std::min(kEdge, args.size());
  const std::size_t tail = std::min(kEdge, args.size() - head);
  copy_range(args, 0, head, edges.data());
  copy_range(args, args.size() - tail, tail, edges.data() + head);
  std::uint64_t h = std::hash<std::string_view>{}(method);
  h ^= std::hash<std::string_view>{}(std::string_view(reinterpret_cast<const char*>(edges.data()), head + tail)) +
       0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  return h ^ (args.size() * 0xff51afd7ed558ccdull);
}

// Whether two payloads hold the same bytes, however they are sliced.
bool same_bytes(const Payload& a, const Payload& b) {
  if (a.size() != b.size()) return false;
  auto sa = a.slices(), sb = b.slices();
  std::size_t ia = 0, ib = 0, oa = 0, ob = 0;
  while (ia < sa.size() && ib < sb.size()) {
    const std::size_t k = std::min(sa[ia].size - oa, sb[ib].size - ob);
    if (std::memcmp(sa[ia].data + oa, sb[ib].data + ob, k) != 0) return false;
    oa += k, ob += k;
    if (oa == sa[ia].size) ++ia, oa = 0;
    if (ob == sb[ib].size) ++ib, ob = 0;
  }
  return true;
}

// The arguments as the entry keeps them: sharing what was received; a copy
// only of a transient view (a slice without an owner), which must not
// outlive the call that made it.
Payload shared_or_copied(const Payload& args) {
  for (const Slice& s : args.slices())
    if (!s.owner) return args.owned_copy();
  return args;
}

}  // namespace

Access Access::any() {
  return Access("any caller", [](const Caller&) { return true; });
}

Access Access::parents() {
  return Access("parents only", [](const Caller& c) {
    return c.auth_id == c.self_id || (c.parent_id && c.auth_id == *c.parent_id);
  });
}

Access Access::when(std::string description, Predicate pred) {
  if (!pred) throw Error("Access::when: empty predicate");
  return Access(std::move(description), std::move(pred));
}

const Reply& Request::reply() {
  if (!reply_.valid()) reply_ = Reply(std::make_shared<ReplyState>(router_, msg_));
  return reply_;
}

Reply Request::defer_reply() {
  deferred_ = true;
  return reply();
}

Service::Service(std::string name, RunMode mode) : name_(std::move(name)), mode_(mode) {
  if (name_.empty() || name_.size() > kMaxNameLength || name_.find('\0') != std::string::npos)
    throw Error(fmt::format("invalid service name '{}': 1 to {} bytes, no NUL", name_, kMaxNameLength));
}

void Service::expose(std::string method, Access access, Method fn, Encoding encoding, bool on_receiver) {
  if (method.empty() || method.size() > kMaxNameLength || method.find('\0') != std::string::npos)
    throw Error(fmt::format("service {}: invalid method name '{}'", name_, method));
  if (!fn) throw Error(fmt::format("service {}: method {} has no function", name_, method));
  if (!methods_.emplace(method, Exposed{std::move(access), std::move(fn), encoding, on_receiver}).second)
    throw Error(fmt::format("service {}: method {} is already exposed", name_, method));
}

const Service::Exposed* Service::find(std::string_view method) const {
  auto it = methods_.find(method);
  return it == methods_.end() ? nullptr : &it->second;
}

std::size_t Service::dedup_pending() const {
  std::lock_guard lk(dedup_mu_);
  return dedup_.size();
}

void Service::run(Request& req, const Exposed& m) {
  if (mode_ == RunMode::kDeduplicated) {
    const std::uint64_t key = dedup_key(req.method(), req.args());
    std::lock_guard lk(dedup_mu_);
    auto [first, last] = dedup_.equal_range(key);
    auto same = std::find_if(first, last, [&](const auto& e) {
      return e.second.method == req.method() && same_bytes(e.second.args, req.args());
    });
    if (same != last) {
      if (auto st = same->second.state.lock(); st && st->join(req.message())) return;
    }
    auto st = req.reply().state();
    if (same != last) {
      same->second.state = st;  // the newer computation is the one to join
    } else {
      dedup_.emplace(key, Computation{req.method(), shared_or_copied(req.args()), st});
    }
    std::weak_ptr<ReplyState> me = st;
    st->on_answered([this, key, me] {
      std::lock_guard lk2(dedup_mu_);
      auto [b, e] = dedup_.equal_range(key);
      // Only our own entry: once answered, a newer call may have replaced it.
      for (auto it = b; it != e; ++it) {
        const auto& w = it->second.state;
        if (!w.owner_before(me) && !me.owner_before(w)) {
          dedup_.erase(it);
          return;
        }
      }
    });
  }
  const Reply& reply = req.reply();
  try {
    Payload result = m.fn(req);
    if (!req.deferred()) reply.send(std::move(result));
  } catch (...) {
    ThrownError t = current_thrown_error();
    // An exception's text often quotes the arguments it choked on: escaped,
    // and summed up, since a caller can send bad arguments as fast as it
    // writes (the caller itself gets each error in its reply).
    static SummaryLog threw;
    threw.note([&] { return fmt::format("service {}: {} threw {}: {:?}", name_, req.method(), t.type, t.message); });
    reply.fail(t.type, t.message);
  }
}

}  // namespace spindle::services
