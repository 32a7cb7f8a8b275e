// Reply: the answer to one service call, sendable once, from any thread.
//
// Role: a handler either returns its result (the host sends it) or keeps a
// Reply (Request::defer_reply()) and answers later, from any thread: send()
// a result, or fail() with a CallError. Copies share one state, so the first
// answer wins and later ones are ignored (sent() says which). A deduplicated
// call's Reply answers every identical request that joined it. If the last
// copy is destroyed unanswered, each caller gets a dead reply
// (reason::kNoReply), so no call waits for its timeout because a handler
// forgot it.
//
// send_dead_reply(): a dead reply from anywhere, including the broker thread
// (it never waits on a full queue; a failure to send is logged).
//
// Thread safety: any thread. Ownership: shares the Router, which must outlive
// every Reply.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "broker/errors.h"
#include "router/router.h"

namespace spindle::services {

void send_dead_reply(Router& router, const Message& request, std::string_view reason);
// Removes a handler on the broker thread, where handlers run, so that none
// is still running it when this returns (plain del_handler() otherwise).
void del_handler_on_broker(Router& router, std::uint32_t handle);

class ReplyState;

class Reply {
 public:
  Reply() = default;
  explicit Reply(std::shared_ptr<ReplyState> st) : st_(std::move(st)) {}
  // Each returns false if the call was already answered.
  bool send(Payload result) const;
  bool fail(std::string_view type, std::string_view message) const;
  bool fail(const std::exception& e) const {
    ThrownError t = thrown_error(e);
    return fail(t.type, t.message);
  }
  bool sent() const;
  bool valid() const { return st_ != nullptr; }
  const std::shared_ptr<ReplyState>& state() const { return st_; }

 private:
  std::shared_ptr<ReplyState> st_;
};

// Shared by the copies of a Reply: the requests to answer.
class ReplyState {
 public:
  ReplyState(Router& router, const Message& request);
  ~ReplyState();
  ReplyState(const ReplyState&) = delete;
  ReplyState& operator=(const ReplyState&) = delete;

  // Adds an identical request to be answered with the same result; false if
  // the answer has already gone (the caller must compute its own).
  // Adds a caller to this pending answer; false once answered or when
  // kMaxJoined callers already wait on it.
  static constexpr std::size_t kMaxJoined = 4096;
  bool join(const Message& request);
  // Runs once, after the answer has gone (the dedup table forgets the key).
  void on_answered(std::function<void()> fn);
  enum class Kind { kResult, kCallError, kDead };
  bool answer(Kind kind, Payload data, std::string_view type = {}, std::string_view text = {});
  bool answered() const;
  std::size_t joined() const;

 private:
  Router& router_;
  mutable std::mutex mu_;
  // Headers only: the arguments are not kept. Each keeps the charge its
  // caller pays while it waits (Message::sender_charge) until it is answered.
  struct Waiting {
    Header header;
    std::shared_ptr<const void> sender_charge;
  };
  std::vector<Waiting> requests_;
  bool answered_ = false;
  std::function<void()> on_answered_;
};

}  // namespace spindle::services
