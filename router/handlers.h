// HandlerTable: the handle registry of one router.
//
// Maps a handle to the function that receives messages sent to it. A handler
// is persistent or one-shot, and may name a respondent (the only context
// allowed to send to it, e.g. the callee of a pending call) and a policy
// predicate. Whoever removes an entry owns its completion: dispatch of a
// one-shot, del, a timeout and a respondent's disconnect all go through
// take(), so each pending call completes exactly once.
//
// Thread safety: all members are safe from any thread (one mutex). Handlers
// are invoked by the caller of take()/find(), never under the lock.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include "stream/message.h"

namespace spindle {

using HandlerFn = std::function<void(Message&&)>;
using Policy = std::function<bool(const Message&)>;

struct HandlerOptions {
  bool persistent = true;
  std::optional<std::uint32_t> respondent;  // only this context may send here
  Policy policy;                            // refuse when it returns false
};

struct Handler {
  HandlerFn fn;
  HandlerOptions opts;
  std::uint32_t handle = 0;
};

using HandlerPtr = std::shared_ptr<const Handler>;

class HandlerTable {
 public:
  // handle == 0 allocates the next free dynamic handle (>= 1000). Returns 0
  // if an explicit handle is already taken.
  std::uint32_t add(HandlerFn fn, HandlerOptions opts, std::uint32_t handle = 0);
  enum class Verdict { kOk, kNotFound, kWrongRespondent, kRefused };
  // For dispatch: checks respondent and policy (under the lock, so policies
  // must be cheap and must not call back into the table), then shares a
  // persistent handler or removes and returns a one-shot one.
  Verdict lookup_for_dispatch(const Message& m, HandlerPtr& out);
  // Removes and returns the handler, if present.
  HandlerPtr take(std::uint32_t handle);
  // Removes and returns every handler whose respondent matches `pred`.
  std::vector<HandlerPtr> take_by_respondent(const std::function<bool(std::uint32_t)>& pred);
  // Removes every one-shot handler (pending calls); persistent ones stay.
  std::vector<HandlerPtr> take_one_shot();
  std::size_t size() const;

 private:
  mutable std::mutex mu_;
  std::unordered_map<std::uint32_t, HandlerPtr> map_;
  std::uint32_t next_dynamic_ = kFirstDynamicHandle;
};

}  // namespace spindle
