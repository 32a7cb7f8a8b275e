// HandlerTable (router/handlers.h): find() answers from its one-entry cache
// only while that handle's handler is the one registered, and a handler
// removed while a Dispatch is open (it removed itself while it ran) lives
// until the last Dispatch closes, and no longer.
#include <memory>

#include <gtest/gtest.h>

#include "router/handlers.h"

namespace spindle {
namespace {

TEST(HandlerTable, FindFollowsRemovalAndReRegistration) {
  HandlerTable t;
  int which = 0;
  const std::uint32_t h = t.add([&](Message&&) { which = 1; }, {});
  ASSERT_NE(h, 0u);
  const Handler* first = t.find(h);
  ASSERT_NE(first, nullptr);
  EXPECT_EQ(t.find(h), first);  // from the cache
  ASSERT_TRUE(t.remove(h));
  EXPECT_EQ(t.find(h), nullptr) << "the cache still answered for a removed handle";
  ASSERT_EQ(t.add([&](Message&&) { which = 2; }, {}, h), h);
  const Handler* second = t.find(h);
  ASSERT_NE(second, nullptr);
  second->fn(Message{});
  EXPECT_EQ(which, 2) << "find() returned the handler removed before";
}

TEST(HandlerTable, AHandlerRemovedWhileDispatchingLivesUntilTheDispatchEnds) {
  HandlerTable t;
  auto state = std::make_shared<int>(7);
  std::weak_ptr<int> alive = state;
  const std::uint32_t h = t.add([state = std::move(state)](Message&&) {}, {});
  {
    HandlerTable::Dispatch outer(t);
    const Handler* running = t.find(h);
    ASSERT_NE(running, nullptr);
    {
      HandlerTable::Dispatch inner(t);  // a nested dispatch (a call completed inside a handler)
      ASSERT_TRUE(t.remove(h));         // the handler removes itself
    }
    EXPECT_FALSE(alive.expired()) << "freed while the outer dispatch still runs it";
    running->fn(Message{});  // still callable: ASan would catch a use after free
  }
  EXPECT_TRUE(alive.expired()) << "kept after the last dispatch ended";
}

TEST(HandlerTable, ARemovalOutsideADispatchFreesAtOnce) {
  HandlerTable t;
  auto state = std::make_shared<int>(7);
  std::weak_ptr<int> alive = state;
  const std::uint32_t h = t.add([state = std::move(state)](Message&&) {}, {});
  ASSERT_TRUE(t.remove(h));
  EXPECT_TRUE(alive.expired());
}

}  // namespace
}  // namespace spindle
