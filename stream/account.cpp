// The per-peer counter and the budget's total move together: the budget is
// what the global limit sees, the account what the peer's limit sees. Relief
// callbacks fire on the release that crosses back under a limit, so a paused
// reader is resumed once, not on every release.
#include "stream/account.h"

#include <unistd.h>

#include <algorithm>

#include <fmt/format.h>

namespace spindle {
namespace {

void raise_peak(std::atomic<std::size_t>& peak, std::size_t now) {
  std::size_t cur = peak.load(std::memory_order_relaxed);
  while (now > cur && !peak.compare_exchange_weak(cur, now, std::memory_order_relaxed)) {
  }
}

}  // namespace

void MemoryBudget::add(std::size_t n) {
  std::size_t now = held_.fetch_add(n, std::memory_order_relaxed) + n;
  raise_peak(peak_, now);
  if (now > limit_) was_over_.store(true, std::memory_order_relaxed);
}

// The release's fetch_sub and its load of the wish are sequentially
// consistent, as is Account::over_awaiting_relief()'s store of the wish and
// its look at the held bytes: of a reader making its wish and a release
// taking the last bytes over, at least one sees the other.
void MemoryBudget::sub(std::size_t n) {
  std::size_t now = held_.fetch_sub(n) - n;
  if (now <= limit_ && was_over_.load() &&
      was_over_.exchange(false, std::memory_order_acq_rel) && relief_)
    relief_();
}

std::uint32_t process_uid() {
  static const std::uint32_t uid = static_cast<std::uint32_t>(::geteuid());
  return uid;
}

std::shared_ptr<UidShare> MemoryBudget::join(std::uint32_t uid) {
  std::lock_guard lk(shares_mu_);
  auto& share = shares_[uid];
  if (!share) {
    share = std::make_shared<UidShare>(uid);
    uids_.fetch_add(1, std::memory_order_relaxed);
  }
  share->peers.fetch_add(1, std::memory_order_relaxed);
  peers_.fetch_add(1, std::memory_order_relaxed);
  return share;
}

void MemoryBudget::leave(const std::shared_ptr<UidShare>& share) {
  std::lock_guard lk(shares_mu_);
  peers_.fetch_sub(1, std::memory_order_relaxed);
  if (share->peers.fetch_sub(1, std::memory_order_relaxed) == 1) {
    shares_.erase(share->uid);
    uids_.fetch_sub(1, std::memory_order_relaxed);
  }
}

Account::Account(std::size_t limit, std::shared_ptr<MemoryBudget> budget, std::optional<std::uint32_t> uid)
    : limit_(limit), budget_(std::move(budget)) {
  if (budget_) share_ = budget_->join(uid.value_or(process_uid()));
}

Account::~Account() {
  if (!budget_) return;
  budget_->leave(share_);
  // Nothing is left charged here: every Charge holds its account alive.
  std::size_t left = held_.load(std::memory_order_relaxed);
  if (left) budget_->sub(left);
}

void Account::charge(std::size_t n) {
  if (n == 0) return;
  std::size_t now = held_.fetch_add(n, std::memory_order_relaxed) + n;
  raise_peak(peak_, now);
  if (budget_) budget_->add(n);
  if (over_with(now)) was_over_.store(true, std::memory_order_relaxed);
}

bool Account::try_charge(std::size_t n) {
  std::size_t cur = held_.load(std::memory_order_relaxed);
  do {
    // An empty account always admits one charge: a single message larger
    // than the limit still goes through, and the account never grows past
    // its limit plus one message.
    if (cur != 0 && over_with(cur + n)) return false;
  } while (!held_.compare_exchange_weak(cur, cur + n, std::memory_order_relaxed));
  raise_peak(peak_, cur + n);
  if (budget_) budget_->add(n);
  if (over_with(cur + n)) was_over_.store(true, std::memory_order_relaxed);
  return true;
}

bool Account::try_charge_within(std::size_t n) {
  // The budget is checked, then charged: accounts charging at once from two
  // threads could each pass the check. A router's streams all adopt their
  // memfds on its broker thread, one after another, so for them it is exact.
  if (budget_ && budget_->held() + n > budget_->limit()) return false;
  return charge_within_own_limit(n);
}

bool Account::charge_within_own_limit(std::size_t n) {
  std::size_t cur = held_.load(std::memory_order_relaxed);
  do {
    if (cur + n > limit_) return false;
  } while (!held_.compare_exchange_weak(cur, cur + n, std::memory_order_relaxed));
  raise_peak(peak_, cur + n);
  if (budget_) budget_->add(n);
  return true;
}

bool Account::try_charge_fair(std::size_t n) {
  if (budget_) {
    const std::size_t total = budget_->held() + n;
    if (total > 2 * budget_->limit()) return false;
    if (total > budget_->limit() && held() + n > fair_share()) return false;
  }
  return charge_within_own_limit(n);
}

bool Account::reserve(std::size_t n) {
  was_over_.store(true, std::memory_order_release);
  if (budget_) budget_->was_over_.store(true, std::memory_order_release);
  return try_charge_within(n);
}

std::string Account::holdings() const {
  return fmt::format("it holds {} of its {} limit{}", held(), limit_,
                     budget_ ? fmt::format("; the router holds {} of {}", budget_->held(), budget_->limit()) : "");
}

bool Account::over_awaiting_relief() {
  if (!over()) return false;
  was_over_.store(true);
  if (budget_) budget_->was_over_.store(true);
  std::atomic_thread_fence(std::memory_order_seq_cst);  // the wish, then the look
  return over();  // a release in between brought it back: no need to wait
}

void Account::release(std::size_t n) {
  if (n == 0) return;
  std::size_t now = held_.fetch_sub(n) - n;  // seq_cst: see MemoryBudget::sub
  if (budget_) budget_->sub(n);
  if (!over_with(now) && was_over_.load() &&
      was_over_.exchange(false, std::memory_order_acq_rel) && relief_)
    relief_();
}

namespace {
// Releases what FdBudget::charge() counted, once, wherever the fds went.
class HeldFds {
 public:
  HeldFds(std::shared_ptr<FdBudget> budget, std::atomic<std::size_t>& held,
          std::shared_ptr<Account> account, std::atomic<std::size_t>* account_fds, std::size_t n)
      : budget_(std::move(budget)), held_(held), account_(std::move(account)),
        account_fds_(account_fds), n_(n) {}
  ~HeldFds() {
    held_.fetch_sub(n_, std::memory_order_relaxed);
    if (account_fds_) account_fds_->fetch_sub(n_, std::memory_order_relaxed);
  }
  HeldFds(const HeldFds&) = delete;
  HeldFds& operator=(const HeldFds&) = delete;

 private:
  std::shared_ptr<FdBudget> budget_;  // keeps `held_` alive
  std::atomic<std::size_t>& held_;
  std::shared_ptr<Account> account_;  // keeps `account_fds_` alive
  std::atomic<std::size_t>* account_fds_;
  std::size_t n_;
};
}  // namespace

bool FdBudget::admits(const Account& a) const {
  const std::size_t h = held();
  if (h < limit_) return true;
  if (h >= 2 * limit_) return false;
  return a.fds() < a.share_of(limit_);
}

std::shared_ptr<void> FdBudget::charge(std::size_t n, std::shared_ptr<Account> account) {
  held_.fetch_add(n, std::memory_order_relaxed);
  std::atomic<std::size_t>* account_fds = account ? &account->fds_ : nullptr;
  if (account_fds) account_fds->fetch_add(n, std::memory_order_relaxed);
  return std::make_shared<HeldFds>(shared_from_this(), held_, std::move(account), account_fds, n);
}

}  // namespace spindle
