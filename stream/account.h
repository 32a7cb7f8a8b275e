// Account: the memory one peer makes this process hold, against its limits.
//
// The accounting rule (docs/PROTOCOL.md §14): every byte the broker holds
// because of a peer is charged to that peer's Account: its output queue, the
// receive chunks its messages pin, the bodies of its large messages and its
// memfd bodies (at their mapped size), and the work it queued for services.
// Each Account has a per-peer limit, and every Account of a router shares one
// MemoryBudget with a global limit. A stream whose account is over() stops
// reading from its peer (back-pressure) until charges are released; what a
// broker-thread producer cannot queue it refuses with a dead reply.
//
// A Charge is the RAII form: it holds the account and the bytes, and releases
// them when destroyed, wherever the charged object travels (a message handed
// to a worker, a chunk kept by a handler). Charging never blocks and never
// allocates.
//
// Thread safety: every member is safe from any thread (atomics). The relief
// callback runs on the thread whose release brought the account back under
// its limit; it must only post work (the stream defers a read to the broker).
// Ownership: shared (shared_ptr): charges keep their account alive.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "spindle/options.h"

namespace spindle {

// How what a peer sends (a large body, a memfd body) is charged to its Account.
enum class PeerCharge {
  kAlways,        // a trusted peer: charged even over the limit (back-pressure follows)
  kWithinLimits,  // an untrusted one: only if it fits its own and the global limit
};

// This process's effective uid, read once: the uid of every peer whose
// credentials nobody checked (a parent, a child) and of this process's own
// work, for the shares below. Cached, since a service message asks it.
std::uint32_t process_uid();

// The peers of one uid among the accounts that share a budget.
struct UidShare {
  explicit UidShare(std::uint32_t u) : uid(u) {}
  const std::uint32_t uid;
  std::atomic<std::size_t> peers{0};
};

// What all the peers of one router may make it hold together.
//
// Fair shares go by uid first: a budget's limit is divided among the uids
// that have peers, then each uid's part among its peers. A router admits
// one uid unless told otherwise (--allow-uid), and then a peer's share is
// limit / peers. With several, a user who opens many connections divides
// only his own part: split by peer, 2,000 connections of one user would
// have left each peer of another user a 2,001st of the budget.
class MemoryBudget {
 public:
  explicit MemoryBudget(std::size_t limit = kDefaultGlobalMemoryLimit) : limit_(limit) {}
  std::size_t held() const { return held_.load(std::memory_order_relaxed); }
  // The most ever held at once (what the limit actually allowed, for stats).
  std::size_t peak() const { return peak_.load(std::memory_order_relaxed); }
  std::size_t limit() const { return limit_; }
  bool over() const { return held() > limit_; }
  // Accounts sharing the budget, and the uids they belong to.
  std::size_t peers() const { return peers_.load(std::memory_order_relaxed); }
  std::size_t uids() const { return uids_.load(std::memory_order_relaxed); }
  // A peer of `share`'s uid's part of `total` (the limit, or an fd budget's).
  std::size_t share_of(std::size_t total, const UidShare& share) const {
    return total / std::max<std::size_t>(1, uids()) /
           std::max<std::size_t>(1, share.peers.load(std::memory_order_relaxed));
  }
  // Called once each time a release brings the budget back under its limit:
  // peers paused only for the global limit may be read again.
  void on_relief(std::function<void()> fn) { relief_ = std::move(fn); }

 private:
  friend class Account;
  void add(std::size_t n);
  void sub(std::size_t n);
  // An account of `uid` joins or leaves (its constructor and destructor).
  std::shared_ptr<UidShare> join(std::uint32_t uid);
  void leave(const std::shared_ptr<UidShare>& share);

  const std::size_t limit_;
  std::atomic<std::size_t> held_{0};
  std::atomic<std::size_t> peak_{0};
  std::atomic<std::size_t> peers_{0};
  std::atomic<std::size_t> uids_{0};
  std::atomic<bool> was_over_{false};
  std::function<void()> relief_;  // set before the budget is shared
  std::mutex shares_mu_;          // shares_: accounts made and gone, never charges
  std::map<std::uint32_t, std::shared_ptr<UidShare>> shares_;  // the uids with peers
};

class Account {
 public:
  // `budget` may be null (a stream on its own, as in tests). `uid`: the
  // peer's (SO_PEERCRED), whose part of the budget it shares; by default
  // this process's (a parent or a child).
  Account(std::size_t limit, std::shared_ptr<MemoryBudget> budget,
          std::optional<std::uint32_t> uid = std::nullopt);
  ~Account();
  Account(const Account&) = delete;
  Account& operator=(const Account&) = delete;

  // Always succeeds: for bytes already in hand (received, or queued by the
  // broker on the peer's behalf). May put the account over its limit.
  void charge(std::size_t n);
  // Succeeds unless the charge would put the account over its limit (an
  // empty account always admits one charge, so a single large message fits).
  bool try_charge(std::size_t n);
  // Succeeds only if, after it, neither this account nor the global budget is
  // over its limit; no exception for an empty account (an untrusted peer's
  // memfd body: one frame that could otherwise charge up to 4 GiB at once).
  bool try_charge_within(std::size_t n);
  // try_charge_within(), and when it fails, the relief callbacks (this
  // account's and the budget's) run at the next release of either, so that
  // whoever waits for the room may ask again. The wish is made before the
  // attempt: a release in between is not missed (at worst one relief runs
  // for nothing).
  bool reserve(std::size_t n);
  // For what a peer makes us keep for good (a router's routes for a client):
  // succeeds if, after it, this account is within its limit and either the
  // budget is within its own, or this account holds no more than its fair
  // share and the budget no more than twice its limit. Past the budget, a
  // peer holding little is still served: FdBudget::admits' rule, in bytes.
  bool try_charge_fair(std::size_t n);
  void release(std::size_t n);

  std::size_t held() const { return held_.load(std::memory_order_relaxed); }
  std::size_t peak() const { return peak_.load(std::memory_order_relaxed); }
  std::size_t limit() const { return limit_; }
  // Over the per-peer limit, or the global budget is over and this peer holds
  // more than its fair share of it: a peer holding little keeps being served
  // while a few others flood. Inline: an untrusted stream asks it for every
  // frame it reads.
  bool over() const { return over_with(held()); }
  // over(), for a reader about to pause until the relief callbacks say it
  // may read again: if over, the wish for relief (this account's and the
  // budget's) is made, then over() asked again, as reserve() does. Without
  // the wish, a charge racing a release could leave the account over with
  // no relief to come (the release cleared the wish the charge had just
  // made), and the paused reader waited for good.
  bool over_awaiting_relief();
  // Its part of the budget's limit (MemoryBudget: by uid, then by peer); its
  // own limit without a budget.
  std::size_t fair_share() const { return budget_ ? budget_->share_of(budget_->limit(), *share_) : limit_; }
  // Its part of `total` by the same rule (FdBudget::admits); all of it
  // without a budget.
  std::size_t share_of(std::size_t total) const { return budget_ ? budget_->share_of(total, *share_) : total; }
  const std::shared_ptr<MemoryBudget>& budget() const { return budget_; }
  // Called once each time a release brings an over() account back under.
  void on_relief(std::function<void()> fn) { relief_ = std::move(fn); }
  // fds received from this peer and still held (FdBudget::charge).
  std::size_t fds() const { return fds_.load(std::memory_order_relaxed); }
  // "it holds <h> of its <l> limit; the router holds <g> of <m>": the end
  // of every refusal for want of room.
  std::string holdings() const;

 private:
  friend class FdBudget;
  bool over_with(std::size_t h) const {
    if (h > limit_) return true;
    return budget_ && budget_->over() && h > fair_share();
  }
  bool charge_within_own_limit(std::size_t n);  // and the budget, unchecked
  std::atomic<std::size_t> fds_{0};

  const std::size_t limit_;
  std::shared_ptr<MemoryBudget> budget_;
  std::shared_ptr<UidShare> share_;  // with a budget: this peer's uid there
  std::atomic<std::size_t> held_{0};
  std::atomic<std::size_t> peak_{0};
  std::atomic<bool> was_over_{false};
  std::function<void()> relief_;  // set before the account is shared
};

// What all the peers of one process may make it hold in file descriptors:
// those received and not yet passed on, handed over or closed. Past the
// limit an untrusted peer's fds are taken only while it holds less than its
// share (the limit divided as the memory budget is: among the uids, then
// among each uid's peers), and never past twice the limit
// (StreamOptions::fd_budget); the kernel discards the rest, and the frames
// they came with are refused. So no client can fill this process's fd table
// however many connections it opens, and one that spends the budget does
// not stop the others passing fds.
//
// Thread safety: every member is safe from any thread. Ownership: shared;
// each charge keeps its budget alive.
class FdBudget : public std::enable_shared_from_this<FdBudget> {
 public:
  explicit FdBudget(std::size_t limit) : limit_(limit) {}
  std::size_t held() const { return held_.load(std::memory_order_relaxed); }
  std::size_t limit() const { return limit_; }
  // Whether fds from the peer of `a` are taken now (the rule above).
  bool admits(const Account& a) const;
  // `n` fds held until the returned charge goes (whoever holds them shares
  // it), charged to `account` too if given.
  std::shared_ptr<void> charge(std::size_t n, std::shared_ptr<Account> account = nullptr);

 private:
  const std::size_t limit_;
  std::atomic<std::size_t> held_{0};
};

// Bytes charged to an account until this object goes.
class Charge {
 public:
  Charge() = default;
  Charge(std::shared_ptr<Account> account, std::size_t n) : account_(std::move(account)), n_(n) {}
  ~Charge() { reset(); }
  Charge(Charge&& o) noexcept : account_(std::move(o.account_)), n_(std::exchange(o.n_, 0)) {}
  Charge& operator=(Charge&& o) noexcept {
    if (this != &o) {
      reset();
      account_ = std::move(o.account_);
      n_ = std::exchange(o.n_, 0);
    }
    return *this;
  }
  Charge(const Charge&) = delete;
  Charge& operator=(const Charge&) = delete;

  std::size_t bytes() const { return n_; }
  explicit operator bool() const { return account_ != nullptr; }
  const std::shared_ptr<Account>& account() const { return account_; }
  // For state that grows and shrinks with a peer's requests (a router's
  // routes for a client): grow() adds `n` bytes if try_charge_fair() takes
  // them (false, nothing charged, if not); add() always does. Without an
  // account nothing is charged, and grow() succeeds.
  bool grow(std::size_t n) {
    if (!account_) return true;
    if (!account_->try_charge_fair(n)) return false;
    n_ += n;
    return true;
  }
  void add(std::size_t n) {
    if (!account_) return;
    account_->charge(n);
    n_ += n;
  }
  void shrink(std::size_t n) {
    if (!account_) return;
    n = std::min(n, n_);
    n_ -= n;
    account_->release(n);
  }
  void reset() {
    if (account_ && n_) account_->release(n_);
    account_.reset();
    n_ = 0;
  }

 private:
  std::shared_ptr<Account> account_;
  std::size_t n_ = 0;
};

}  // namespace spindle
