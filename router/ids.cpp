// Context ids, and where they come from. The root hands them out: first
// fresh, from a counter (a compare-and-swap, so any thread may take one and
// two callers never get the same id); then, once the counter has reached
// the end of the id space, round again from the start, in order, as Linux
// hands out pids, skipping every id still in use (id_in_use). A non-root
// router asks the root for blocks (allocate_id).
//
// Why round again: ids are spent by peers, one per connection and one per
// ALLOCATE_ID that a client sends, whether or not it ever uses them. A
// counter that stopped at its end let one client stop the root taking any
// new client or child, for good: one Python client sending ALLOCATE_ID on
// connection after connection spends 2.4 to 2.8 million ids a second, all 4
// billion in under half an hour (scripts/id_burn.py). Round again, an id
// comes back only after every other id not in use has been handed out since
// it was, so a departed context's id is not seen again for a long time (4
// billion allocations, or half an hour of that flood), and never while
// anything routes to it.
#include "router/router.h"

#include <algorithm>
#include <functional>
#include <future>
#include <limits>

#include "broker/errors.h"
#include "broker/log.h"
#include "router/control.h"
#include "router/reasons.h"

namespace spindle {
namespace {
constexpr std::uint32_t kIdEnd = std::numeric_limits<std::uint32_t>::max();  // never handed out
// How far one search for a free id may look, past the ids in use however
// they cluster: far more than the routes and grants the limits allow.
constexpr std::uint64_t kMaxIdSearch = std::uint64_t{1} << 26;
}  // namespace

std::uint32_t Router::allocate_id() {
  if (!parent_id()) {
    if (auto ids = take_ids(1)) return ids->first;
    throw Error(std::string(reason::kIdsExhausted));
  }
  // Refused there even when a spare id would not block: one rule, whatever
  // the block holds.
  if (broker_.on_broker_thread()) throw Error("allocate_id() would block the broker thread");
  {
    std::lock_guard lk(spare_ids_mu_);
    if (!spare_ids_.empty()) {
      const std::uint32_t id = spare_ids_.back();
      spare_ids_.pop_back();
      return id;
    }
  }
  // A block, not one id (PROTOCOL.md 6.4): the next children of this
  // context cost no round trip to the root, which may be hosts away.
  Message reply = call(Message::make(0, kHandleAllocateId, Payload::copy_of(std::to_string(IdGrants::kMaxIdBlock)),
                                     kEncMitogen),
                       std::chrono::milliseconds(10000));
  auto range = parse_id_range(reply.text());
  if (!range || range->second > IdGrants::kMaxIdBlock) throw Error("malformed ALLOCATE_ID reply: " + reply.text());
  const auto [first, count] = *range;
  std::lock_guard lk(spare_ids_mu_);
  // Kept descending, so that children get ascending ids; a block that
  // another thread fetched at the same time simply joins this one.
  for (std::uint32_t i = 1; i < count; ++i) spare_ids_.push_back(first + i);
  std::sort(spare_ids_.begin(), spare_ids_.end(), std::greater<>());
  return first;
}

bool Router::holds_spare_id(std::uint32_t id) {
  std::lock_guard lk(spare_ids_mu_);
  return std::find(spare_ids_.begin(), spare_ids_.end(), id) != spare_ids_.end();
}

std::optional<std::pair<std::uint32_t, std::uint32_t>> Router::take_ids(std::uint32_t count) {
  std::uint32_t next = next_id_.load(), n = 0;
  do {
    if (next == kIdEnd) return take_free_ids(count);
    n = std::min(count, kIdEnd - next);
  } while (!next_id_.compare_exchange_weak(next, next + n));
  return std::pair{next, n};
}

// Broker thread (other threads wait for it): routes_ and the grants live
// there. A block is the run of free ids that starts at the first free one,
// up to `count` of them.
std::optional<std::pair<std::uint32_t, std::uint32_t>> Router::take_free_ids(std::uint32_t count) {
  if (!broker_.on_broker_thread()) {
    std::promise<std::optional<std::pair<std::uint32_t, std::uint32_t>>> done;
    auto f = done.get_future();
    if (!broker_.try_defer([&] { done.set_value(take_free_ids(count)); })) return std::nullopt;
    return f.get();
  }
  if (!ids_wrapped_) {
    ids_wrapped_ = true;
    log().warn("every context id has been handed out once: ids not in use are handed out again, "
               "oldest first");
  }
  auto step = [](std::uint32_t id) { return id + 1 == kIdEnd ? 1 : id + 1; };
  for (std::uint64_t looked = 0; looked < kMaxIdSearch; ++looked) {
    const std::uint32_t first = reuse_cursor_;
    reuse_cursor_ = step(first);
    if (id_in_use(first)) continue;
    std::uint32_t n = 1;
    while (n < count && reuse_cursor_ == first + n && !id_in_use(reuse_cursor_)) {
      reuse_cursor_ = step(reuse_cursor_);
      ++n;
    }
    return std::pair{first, n};
  }
  return std::nullopt;
}

// A living context's (routed here: every context routes through the
// root), or granted to a link and not announced yet (granted_, the union
// of the links' IdGrants). Two lookups: looking through each link's grants
// cost a search per id per link, which 4,096 clients holding grants could
// make the root pay for every id handed out after the wrap.
bool Router::id_in_use(std::uint32_t id) const {
  return id == id_.load(std::memory_order_relaxed) || routes_.count(id) || granted_.holds(id);
}

void Router::skip_ids_for_testing(std::uint32_t next) {
  std::uint32_t cur = next_id_.load();
  while (cur < next && !next_id_.compare_exchange_weak(cur, next)) {
  }
}

}  // namespace spindle
