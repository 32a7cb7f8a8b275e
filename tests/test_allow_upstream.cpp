// Allow::kUpstream: a function that answers the contexts above its context
// (the agent's spindle.ssh and spindle.fork start processes with it) answers
// the parent and the grandparent, and refuses a sibling, whose calls also
// arrive through the parent link. Real forks, three levels:
//
//   root (this process) ── A ── B (exposes guarded, kUpstream)
//        └─ S (a sibling of A: calls B through the root and A)
//
// A sibling cannot make itself an ancestor by sending ANCESTORS either: only
// the context at the other end of the parent link is believed.
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include <spindle/spindle.h>

#include "router/child.h"
#include "router/router.h"

namespace test_allow_upstream {

using namespace std::chrono_literals;

inline constexpr spindle::method<std::string()> guarded{"guarded"};
inline constexpr spindle::method<long()> start_b{"start_b"};
// What a sibling gets when it calls B: "answered", or the error's text.
inline constexpr spindle::method<std::string(long)> poke{"poke"};
// The sibling first claims to be above B (ANCESTORS naming itself), then pokes.
inline constexpr spindle::method<std::string(long)> forge_then_poke{"forge_then_poke"};
inline constexpr spindle::method<std::vector<long>()> ancestors_of_b{"ancestors"};

int b_main(spindle::ChildEnv& env) {
  env.expose(guarded, [] { return std::string("answered"); }, spindle::Allow::kUpstream);
  env.expose(ancestors_of_b, [&env] {
    std::vector<long> out;
    for (std::uint32_t id : env.router().ancestors()) out.push_back(id);
    return out;
  }, spindle::Allow::kAnyone);
  return env.serve();
}

int a_main(spindle::ChildEnv& env) {
  std::vector<spindle::Context> kept;
  env.expose(start_b, [&env, &kept] {
    kept.push_back(spindle::fork_child(env.router(), b_main, {.name = "b"}));
    return static_cast<long>(kept.back().id());
  });
  return env.serve();
}

std::string call_guarded(spindle::ChildEnv& env, long b) {
  try {
    spindle::Context ctx(env.router(), static_cast<std::uint32_t>(b), "b");
    return ctx.with_timeout(10s).call(guarded);
  } catch (const std::exception& e) {
    return e.what();
  }
}

int s_main(spindle::ChildEnv& env) {
  env.expose(poke, [&env](long b) { return call_guarded(env, b); });
  env.expose(forge_then_poke, [&env](long b) {
    spindle::Context ctx(env.router(), static_cast<std::uint32_t>(b), "b");
    ctx.send(spindle::kHandleAncestors, std::to_string(env.id()));
    return call_guarded(env, b);
  });
  return env.serve();
}

TEST(AllowUpstream, TheGrandparentIsAnsweredAndASiblingIsRefused) {
  spindle::Runtime rt;
  spindle::Child a = rt.fork_child(a_main, {.name = "a"});
  spindle::Child s = rt.fork_child(s_main, {.name = "s"});
  const long b = a.with_timeout(10s).call(start_b);
  spindle::Context to_b = rt.context(static_cast<std::uint32_t>(b), "b").with_timeout(10s);

  // B knows who is above it: A, then the root.
  EXPECT_EQ(to_b.call(ancestors_of_b), (std::vector<long>{static_cast<long>(a.id()), static_cast<long>(rt.id())}));
  EXPECT_EQ(to_b.call(guarded), "answered");  // the grandparent

  for (const auto& m : {poke, forge_then_poke}) {
    const std::string got = s.with_timeout(20s).call(m, b);
    EXPECT_NE(got.find("refused by service policy"), std::string::npos) << m.name() << ": " << got;
  }
  // The forged list changed nothing.
  EXPECT_EQ(to_b.call(ancestors_of_b), (std::vector<long>{static_cast<long>(a.id()), static_cast<long>(rt.id())}));
  EXPECT_EQ(s.stop(), 0);
  EXPECT_EQ(a.stop(), 0);
}

// A child cannot tell its parent who is above the parent.
TEST(AllowUpstream, AChildsAncestorsMessageIsRefusedByItsParent) {
  spindle::Runtime rt;
  spindle::Child c = rt.fork_child([](spindle::ChildEnv& env) {
    env.parent().send(spindle::kHandleAncestors, std::string("7,8"));
    return env.serve();
  }, {.name = "liar"});
  // A call round trip after the send: the frame was handled before the reply.
  EXPECT_THROW(c.with_timeout(10s).call<long>("nothing exposed"), spindle::Error);
  EXPECT_TRUE(rt.router().ancestors().empty());
  EXPECT_FALSE(rt.router().is_ancestor(7));
  EXPECT_EQ(c.stop(), 0);
}

}  // namespace test_allow_upstream
