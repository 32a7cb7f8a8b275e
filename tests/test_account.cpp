// Account and MemoryBudget (stream/account.h): the arithmetic behind the
// accounting rule of issue #11 §1 (docs/PROTOCOL.md §14), without a router:
// the per-peer limit, the fair share under an exceeded global limit, the
// admission of memfd bodies (try_charge_within), and relief callbacks that
// fire once per return under a limit (a paused reader is resumed once, not
// on every release).
#include <unistd.h>

#include <memory>
#include <vector>

#include <gtest/gtest.h>

#include "stream/account.h"
#include "stream/rx_buffer.h"

namespace spindle {
namespace test_account {

TEST(Account, OverItsOwnLimitOnlyPastIt) {
  Account a(1000, nullptr);
  a.charge(1000);
  EXPECT_FALSE(a.over()) << "at the limit is not over it";
  a.charge(1);
  EXPECT_TRUE(a.over());
  a.release(1);
  EXPECT_FALSE(a.over());
  EXPECT_EQ(a.held(), 1000u);
  EXPECT_EQ(a.peak(), 1001u);
}

TEST(Account, TryChargeAdmitsOneLargeMessageIntoAnEmptyAccountOnly) {
  Account a(1000, nullptr);
  EXPECT_TRUE(a.try_charge(5000)) << "an empty account takes one message of any size";
  EXPECT_FALSE(a.try_charge(1)) << "and nothing after it while it is over";
  a.release(5000);
  EXPECT_TRUE(a.try_charge(600));
  EXPECT_FALSE(a.try_charge(600)) << "600 + 600 would be over 1000";
  EXPECT_TRUE(a.try_charge(400));
  EXPECT_EQ(a.held(), 1000u);
}

// A memfd body from an untrusted peer: it must fit both the peer's own
// limit and the global one, even into an empty account.
TEST(Account, TryChargeWithinKeepsBothLimitsEvenForAnEmptyAccount) {
  auto budget = std::make_shared<MemoryBudget>(10'000);
  Account a(4000, budget), b(100'000, budget);
  EXPECT_FALSE(a.try_charge_within(4001)) << "over the peer's own limit";
  EXPECT_TRUE(a.try_charge_within(4000));
  EXPECT_FALSE(b.try_charge_within(6001)) << "over what the budget has left";
  EXPECT_TRUE(b.try_charge_within(6000));
  EXPECT_EQ(budget->held(), 10'000u);
  EXPECT_FALSE(b.try_charge_within(1));
  a.release(4000);
  b.release(6000);
  EXPECT_EQ(budget->held(), 0u);
  EXPECT_EQ(budget->peak(), 10'000u);
}

// Over the global limit, the peers holding more than limit / peers are over;
// the others are not, whatever their own limits.
TEST(Account, AnExceededBudgetStopsOnlyThePeersOverTheirFairShare) {
  auto budget = std::make_shared<MemoryBudget>(9000);
  Account big(1'000'000, budget), mid(1'000'000, budget), small(1'000'000, budget);
  EXPECT_EQ(budget->peers(), 3u);
  EXPECT_EQ(big.fair_share(), 3000u);
  big.charge(8000);
  mid.charge(900);
  EXPECT_FALSE(budget->over());
  EXPECT_FALSE(big.over()) << "the budget is not exceeded yet";
  small.charge(200);  // 9100 in all
  EXPECT_TRUE(budget->over());
  EXPECT_TRUE(big.over()) << "8000 is over its fair share of 3000";
  EXPECT_FALSE(mid.over());
  EXPECT_FALSE(small.over());
  big.release(200);  // 8900: back under the global limit
  EXPECT_FALSE(big.over());
  {
    Account fourth(1'000'000, budget);  // a new peer shrinks everyone's share
    EXPECT_EQ(small.fair_share(), 2250u);
  }
  EXPECT_EQ(budget->peers(), 3u);
}

// With peers of several uids (a router with --allow-uid), the limit is
// divided among the uids first: a user who opens many connections divides
// his own part, not the others'. Before, a peer's share was limit / peers,
// and the 8 connections of one uid left the one peer of another a ninth.
TEST(Account, TheFairShareIsDividedAmongTheUidsFirst) {
  constexpr std::uint32_t kMine = 1000, kOther = 2000;
  auto budget = std::make_shared<MemoryBudget>(8000);
  std::vector<std::unique_ptr<Account>> flood;
  for (int i = 0; i < 8; ++i) flood.push_back(std::make_unique<Account>(1'000'000, budget, kOther));
  Account alone(1'000'000, budget, kMine);
  EXPECT_EQ(budget->peers(), 9u);
  EXPECT_EQ(budget->uids(), 2u);
  EXPECT_EQ(alone.fair_share(), 4000u) << "half the limit for the uid, all of it for its one peer";
  EXPECT_EQ(flood[0]->fair_share(), 500u) << "the other half among the 8 of the other uid";
  for (auto& a : flood) a->charge(1100);  // 8800: the budget is over
  alone.charge(3000);
  ASSERT_TRUE(budget->over());
  EXPECT_FALSE(alone.over()) << "3000 is within its uid's 4000";
  EXPECT_TRUE(flood[0]->over()) << "1100 is over its 500";
  EXPECT_TRUE(alone.try_charge_fair(900)) << "3900 fits its share, under twice the limit";
  EXPECT_FALSE(flood[1]->try_charge_fair(1)) << "a flooder over its share gets no more state";
  // A uid whose last peer goes gives its part back.
  flood.clear();
  EXPECT_EQ(budget->uids(), 1u);
  EXPECT_EQ(alone.fair_share(), 8000u);
  // Without a uid, an account is this process's: one uid with a peer of
  // that uid, and a second uid beside any other.
  Account own(1'000'000, budget, static_cast<std::uint32_t>(::geteuid()));
  Account defaulted(1'000'000, budget);
  EXPECT_EQ(budget->uids(), kMine == ::geteuid() ? 1u : 2u);
  EXPECT_EQ(own.fair_share(), defaulted.fair_share());
}

// The fd budget divides its limit the same way: past the limit, a peer's
// fds are taken while it holds less than its uid's part among its peers.
TEST(Account, TheFdBudgetIsDividedAmongTheUidsFirst) {
  auto budget = std::make_shared<MemoryBudget>(1 << 20);
  auto fds = std::make_shared<FdBudget>(8);
  std::vector<std::shared_ptr<Account>> flood;
  for (int i = 0; i < 4; ++i) flood.push_back(std::make_shared<Account>(1 << 20, budget, 2000));
  auto alone = std::make_shared<Account>(1 << 20, budget, 1000);
  std::vector<std::shared_ptr<void>> held;
  for (auto& a : flood) held.push_back(fds->charge(2, a));  // 8 fds: the limit reached
  EXPECT_FALSE(fds->admits(*flood[0])) << "2 fds, over its 8 / 2 uids / 4 peers = 1";
  EXPECT_TRUE(fds->admits(*alone));
  held.push_back(fds->charge(3, alone));
  EXPECT_TRUE(fds->admits(*alone)) << "3 fds, under its uid's 4";
  held.push_back(fds->charge(1, alone));
  EXPECT_FALSE(fds->admits(*alone)) << "4 fds: its uid's part is spent";
}

TEST(Account, ReliefFiresOnceEachTimeALimitIsLeftBehind) {
  auto budget = std::make_shared<MemoryBudget>(1000);
  int budget_reliefs = 0, account_reliefs = 0;
  budget->on_relief([&] { ++budget_reliefs; });
  Account a(500, budget);
  a.on_relief([&] { ++account_reliefs; });
  a.charge(400);
  a.release(100);
  EXPECT_EQ(account_reliefs, 0) << "never over: nothing to relieve";
  a.charge(300);  // 600: over its own limit
  a.release(50);  // 550: still over
  EXPECT_EQ(account_reliefs, 0);
  a.release(100);  // 450: under
  EXPECT_EQ(account_reliefs, 1);
  a.release(100);
  EXPECT_EQ(account_reliefs, 1) << "a release that stays under does not fire again";
  a.charge(700);   // 1050: over both
  a.release(100);  // 950: under the budget, still over its own limit
  EXPECT_EQ(budget_reliefs, 1);
  EXPECT_EQ(account_reliefs, 1);
  a.release(950);
  EXPECT_EQ(account_reliefs, 2);
  EXPECT_EQ(budget_reliefs, 1);
}

// reserve(): what does not fit now asks for a relief at the next release, of
// this account or of any account on the budget, and the relief comes even
// though no limit was ever exceeded (an untrusted peer's large body waits for
// room: stream/parser.h).
TEST(Account, AFailedReserveIsToldOfTheNextRelease) {
  auto budget = std::make_shared<MemoryBudget>(10'000);
  int budget_reliefs = 0, a_reliefs = 0;
  budget->on_relief([&] { ++budget_reliefs; });
  Account a(6000, budget), other(10'000, budget);
  a.on_relief([&] { ++a_reliefs; });
  ASSERT_TRUE(a.reserve(4000));
  a.release(100);  // the wish made before a successful reserve: one relief for nothing
  EXPECT_EQ(a_reliefs, 1);
  a.release(100);
  EXPECT_EQ(a_reliefs, 1) << "a relief is asked for once per reserve";
  EXPECT_EQ(a.held(), 3800u);
  budget_reliefs = 0;

  EXPECT_FALSE(a.reserve(3000)) << "over its own limit of 6000";
  EXPECT_EQ(a.held(), 3800u) << "a failed reserve charges nothing";
  EXPECT_FALSE(a.over()) << "nothing is exceeded: the body waits, it is not charged";
  a.release(800);
  EXPECT_EQ(a_reliefs, 2) << "its own release tells the waiter";
  EXPECT_TRUE(a.reserve(3000));
  EXPECT_EQ(a.held(), 6000u);

  // The budget's room: another peer's release tells the waiter.
  a.release(3000);     // a: 3000; the budget: 3000
  other.charge(6500);  // the budget: 9500 of 10000
  budget_reliefs = 0;
  EXPECT_FALSE(a.reserve(1000)) << "a's limit has room; the budget has not";
  EXPECT_EQ(budget->held(), 9500u);
  other.release(600);  // 8900
  EXPECT_EQ(budget_reliefs, 1) << "another peer's release tells the waiter";
  EXPECT_TRUE(a.reserve(1000));
  EXPECT_EQ(budget->held(), 9900u);
  a.release(4000);
  other.release(5900);
  EXPECT_EQ(budget->held(), 0u);
}

// A Charge releases what it holds wherever it ends up, once.
TEST(Account, AChargeReleasesOnceWhereverItGoes) {
  auto budget = std::make_shared<MemoryBudget>(1000);
  auto a = std::make_shared<Account>(1000, budget);
  a->charge(300);
  Charge c(a, 300);
  Charge moved = std::move(c);
  EXPECT_FALSE(c);
  EXPECT_EQ(a->held(), 300u);
  {
    Charge taker;
    taker = std::move(moved);
  }
  EXPECT_EQ(a->held(), 0u);
  EXPECT_EQ(budget->held(), 0u);
  // An account that goes with charges left gives them back to the budget.
  {
    Account gone(1000, budget);
    gone.charge(700);
    EXPECT_EQ(budget->held(), 700u);
  }
  EXPECT_EQ(budget->held(), 0u);
}

// A receive chunk that a message still holds when its stream goes (the
// peer left) is charged to the peer's account until the message lets go,
// as a chunk retired earlier is. Before, the chunk being filled was charged
// to nobody: a client that reconnected in a loop, each time leaving a
// message queued behind a slow receiver, pinned 128 KiB per connection.
TEST(Account, AChunkAMessageHoldsWhenItsBufferGoesIsChargedUntilReleased) {
  auto account = std::make_shared<Account>(1u << 20, nullptr);
  Payload kept;
  {
    RxBuffer rx;
    rx.set_account(account);
    auto space = rx.write_space();
    ASSERT_GE(space.size(), 100u);
    std::fill_n(space.data(), 100, std::uint8_t{7});
    rx.commit(100);
    kept = rx.take(40);  // a message from a chunk not yet full
    rx.drop(60);
    EXPECT_EQ(account->held(), 0u) << "the chunk is still the buffer's own";
  }
  EXPECT_EQ(account->held(), kChunkSize);
  EXPECT_EQ(kept.size(), 40u);
  kept = Payload();
  EXPECT_EQ(account->held(), 0u);
}

}  // namespace test_account
}  // namespace spindle
