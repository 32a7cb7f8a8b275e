// The Router's frame: construction and teardown, the handler registry, the
// held-message budget of a starting child, and stats. The data path is split
// by thread: send.cpp is what application threads do (and the outbox the
// broker drains), forward.cpp is what the broker thread does with frames
// that arrive, calls.cpp completes calls, links.cpp owns the streams and the
// control handles.
#include "router/router.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <functional>

#include <fmt/format.h>

#include "broker/errors.h"
#include "broker/log.h"
#include "broker/summary_log.h"
#include "router/control.h"
#include "router/reasons.h"

namespace spindle {
namespace {
std::atomic<std::uint64_t> g_router_serial{1};

// RouterOptions::fd_limit, or half of the fds this process may open: the
// other half stays for its own connections, files and children, whatever
// its peers send.
std::size_t fd_limit_for(std::size_t configured) {
  if (configured != 0) return configured;
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return 1u << 20;
  return std::max<std::size_t>(64, static_cast<std::size_t>(rl.rlim_cur) / 2);
}
}  // namespace

// Lets a release on any thread (a payload let go long after) ask the router
// to resume the peers it paused for the global limit, without touching a
// router that is gone: the router clears it first thing as it dies.
struct BudgetRelief {
  std::mutex mu;
  Broker* broker = nullptr;
  std::function<void()> resume;
  void fire() {
    std::lock_guard lk(mu);
    if (broker) broker->try_post(resume);
  }
};

Router::Router(Broker& broker, RouterOptions opts)
    : broker_(broker),
      opts_(std::move(opts)),
      serial_(g_router_serial.fetch_add(1)),
      budget_(std::make_shared<MemoryBudget>(opts_.memory_limit)),
      fd_budget_(std::make_shared<FdBudget>(fd_limit_for(opts_.fd_limit))),
      state_budget_(std::make_shared<MemoryBudget>(opts_.memory_limit)),
      relief_(std::make_shared<BudgetRelief>()),
      calls_(&broker),
      outbox_(opts_.outbox_size),
      call_timer_(broker.io()) {
  if (opts_.max_message_size == 0) throw Error("max_message_size must be at least 1 byte");
  relief_->broker = &broker_;
  link_->router.store(this, std::memory_order_release);
  relief_->resume = [this] {
    for (auto& [s, l] : links_) l->stream->resume_reading();
  };
  budget_->on_relief([r = relief_] { r->fire(); });
  // ALLOCATE_ID is answered by the root only: others forward it upwards.
  // Registered here, not through add_handler(): nothing of this router runs
  // on the broker thread before the defer below, which publishes the table
  // with everything else. add_handler() from this thread would wait for the
  // broker thread, a hand-off every context paid at birth (each forked
  // worker, each child, each Connection).
  handlers_.add([this](Message&& m) { allocate_for(std::move(m)); }, {}, kHandleAllocateId);
  broker_.defer([this] {
    broker_.add_participant(this);
    wake_sink_ = broker_.on_wake([this] { return drain_outbox(); });
  });
}

Router::~Router() {
  {
    std::lock_guard lk(relief_->mu);
    relief_->broker = nullptr;
  }
  broker_.shutdown();
  if (!broker_.on_broker_thread()) broker_.join();
  // The broker thread is gone: nothing else touches our state now.
  std::vector<std::shared_ptr<Stream>> streams;
  for (auto& [s, link] : links_) streams.push_back(link->stream);
  for (auto& s : streams) s->close(std::string(reason::kShuttingDown));
  if (parent_watch_) {
    std::error_code ignored;
    parent_watch_->close(ignored);
  }
  auto why = std::make_exception_ptr(ChannelError(std::string(reason::kShuttingDown)));
  calls_.fail_where([](std::uint32_t) { return true; }, [&](std::uint32_t) { return why; });
  broker_.remove_participant(this);
  // Last: a Context inside an operation is inside the link's gate; it finds
  // the broker stopped and its call failed, and leaves.
  link_->gate.close_and_wait();
  link_->router.store(nullptr, std::memory_order_release);
}

std::optional<std::uint32_t> Router::parent_id() const {
  std::lock_guard lk(ports_mu_);
  return parent_id_;
}

Router::ShareKey Router::share_key(std::uint32_t auth_id) const {
  std::lock_guard lk(ports_mu_);
  auto it = ports_.find(auth_id);
  if (it == ports_.end() || (parent_port_.port && it->second.port == parent_port_.port))
    return {auth_id, process_uid()};
  return {(std::uint64_t{1} << 32) + it->second.serial, it->second.port->uid};  // above every context id
}

std::uint32_t Router::add_handler(HandlerFn fn, HandlerOptions opts, std::uint32_t handle) {
  std::uint32_t h = 0;
  auto add = [&] { h = handlers_.add(std::move(fn), std::move(opts), handle); };
  if (broker_.on_broker_thread() || broker_.state() == Broker::State::kStopped) {
    add();
  } else {
    // The table belongs to the broker thread: register there, and return
    // only once a message sent from here on will find the handler.
    std::promise<void> done;
    auto f = done.get_future();
    if (broker_.try_defer([&] {
          add();
          done.set_value();
        }))
      f.wait();
    else
      add();  // the broker has just stopped: nothing dispatches any more
  }
  if (h == 0) throw Error(fmt::format("handle {} is already registered", handle));
  return h;
}

bool Router::del_handler(std::uint32_t handle) {
  bool removed = false;
  auto del = [&] { removed = handlers_.remove(handle); };
  if (broker_.on_broker_thread() || broker_.state() == Broker::State::kStopped) {
    del();
    return removed;
  }
  std::promise<void> done;
  auto f = done.get_future();
  if (broker_.try_defer([&] {
        del();
        done.set_value();
      }))
    f.wait();
  else
    del();
  return removed;
}

void Router::on_disconnect(std::uint32_t context_id, std::function<void(const std::string&)> fn) {
  std::lock_guard lk(disconnect_mu_);
  disconnect_watchers_[context_id].push_back(std::move(fn));
}

bool Router::watch_if_routed(std::uint32_t context_id, std::function<void(const std::string&)> fn) {
  // On the broker thread, where links come and go, "routed now" and "the
  // watcher is in place" are one step: a context cannot leave in between
  // and leave the watcher waiting forever.
  auto watch = [&] {
    if (!routes_.count(context_id)) return false;
    on_disconnect(context_id, std::move(fn));
    return true;
  };
  if (broker_.on_broker_thread()) return watch();
  std::promise<bool> done;
  auto f = done.get_future();
  if (!broker_.try_defer([&] { done.set_value(watch()); })) return false;
  return f.get();
}

RouterStats Router::stats() {
  auto collect = [this] {
    RouterStats s = stats_;
    s.streams = links_.size();
    s.routes = routes_.size();
    s.handlers = handlers_.size();
    s.pending_calls = calls_.pending();
    s.call_slots = calls_.slots();
    s.memory_held = budget_->held();
    s.memory_peak = budget_->peak();
    s.memory_limit = budget_->limit();
    s.fds_held = fd_budget_->held();
    s.fd_limit = fd_budget_->limit();
    s.state_held = state_budget_->held();
    s.state_limit = state_budget_->limit();
    for (const auto& [stream, link] : links_)
      s.direct_writes += stream->port()->direct_writes.load(std::memory_order_relaxed);
    return s;
  };
  if (broker_.on_broker_thread() || broker_.state() == Broker::State::kStopped) return collect();
  std::promise<RouterStats> p;
  auto f = p.get_future();
  if (!broker_.try_defer([&] { p.set_value(collect()); })) return collect();
  return f.get();
}

// Holds `m` unless that would exceed the budget (high_water_mark bytes). A
// message is charged at what it keeps: its bytes, and each fd it carries
// (a memfd body too) at fd_charge(), as on a send queue; counted by bytes
// alone, a peer could make a client that is not ready hold 300,000 fds. Its
// bytes are copied out of the receive chunk, which a message of a few bytes
// would otherwise keep whole (128 KiB). A body that is a range of a memfd
// with bytes around it (PROTOCOL.md 13.7) is held like a memfd body: its
// memfd is charged to the sender's account, only the bytes around count
// here, and they are not copied (they live in the mapping, not in a chunk).
bool Router::hold(Message& m) {
  const MemfdSpan& span = m.data.memfd_span();
  const bool in_memfd = m.sealed_body || span.memfd;
  const std::size_t size = kHeaderSize + m.data.size() - span.length + fd_charge(m.fds.size() + (in_memfd ? 1 : 0));
  if (held_bytes_ + size > opts_.high_water_mark) {
    // A peer can send these as fast as it writes: summed up.
    static SummaryLog over_budget(spdlog::level::warn);
    over_budget.note([&] {
      return fmt::format("held-message budget of {} bytes exhausted; handle {} is answered now",
                         opts_.high_water_mark, m.header.handle);
    });
    return false;
  }
  if (!span.memfd) m.data = m.data.owned_copy();
  held_bytes_ += size;
  held_handles_.insert(m.header.handle);
  held_unknown_.push_back(std::move(m));
  return true;
}

void Router::release_held() {
  hold_unknown_ = false;
  std::vector<Message> held;
  held.swap(held_unknown_);
  held_bytes_ = 0;
  held_handles_.clear();
  for (Message& m : held) dispatch_local(std::move(m));
  maybe_drained();  // a router still holding was not drained
}

void Router::hold_unknown_handles(bool hold) {
  // Synchronous (inline on the broker thread), so that after ready() every
  // held message has been handled.
  // After the broker stopped there is nothing to wait for: shutdown already
  // answered whatever was held.
  std::promise<void> done;
  auto f = done.get_future();
  if (broker_.try_defer([&] {
        if (hold) hold_unknown_ = true;
        else release_held();
        done.set_value();
      }))
    f.wait();
}

}  // namespace spindle
