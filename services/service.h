// Service: a named set of methods, each callable only under a policy.
//
// Role: what a ServiceHost dispatches CALL_SERVICE requests to. A method is
// exposed with an Access policy, and nothing else is callable:
//   Access::any()      every caller;
//   Access::parents()  the caller's auth_id is this context or its parent
//                      (Allow::kUpstream, api/child.h, admits the chain
//                      above too);
//   Access::when(...)  a predicate over the Caller.
// A service runs its calls in one of three modes:
//   kConcurrent   on as many workers as are free;
//   kSerialized   one at a time, in arrival order;
//   kDeduplicated concurrent, but a call identical (same method and argument
//                 bytes) to one still running joins it and gets its answer.
// A method returns its result, or keeps the Reply (Request::defer_reply())
// and answers later from any thread. An exception becomes a CallError reply
// naming its type and message; the worker goes on.
//
// Thread safety: expose() before the service is added to a host; after that
// the service is read-only except its dedup table (own mutex). Methods run on
// pool workers, concurrently unless the mode says otherwise.
// Ownership: a ServiceHost owns its services.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>

#include "services/reply.h"
#include "spindle/payload.h"

namespace spindle::services {

enum class RunMode { kConcurrent, kSerialized, kDeduplicated };

// How a method's arguments and result are encoded: raw bytes, or msgpack
// (a typed method, <spindle/method.h>; the envelope's msgpack flag).
enum class Encoding { kRaw, kMsgpack };

// Who is calling, as the policies see it.
struct Caller {
  std::uint32_t src_id = 0;
  std::uint32_t auth_id = 0;
  std::uint32_t self_id = 0;                 // this context
  std::optional<std::uint32_t> parent_id;    // this context's parent, if any
};

class Access {
 public:
  using Predicate = std::function<bool(const Caller&)>;
  static Access any();
  static Access parents();
  static Access when(std::string description, Predicate pred);
  bool allows(const Caller& c) const { return pred_(c); }
  const std::string& description() const { return description_; }

 private:
  Access(std::string d, Predicate p) : description_(std::move(d)), pred_(std::move(p)) {}
  std::string description_;
  Predicate pred_;
};

class Request {
 public:
  Request(Router& router, Message msg, Caller caller, std::string service, std::string method,
          Payload args)
      : router_(router), msg_(std::move(msg)), caller_(caller), service_(std::move(service)),
        method_(std::move(method)), args_(std::move(args)) {}
  const Caller& caller() const { return caller_; }
  const std::string& service() const { return service_; }
  const std::string& method() const { return method_; }
  const Payload& args() const { return args_; }
  std::string args_text() const { return args_.to_string(); }
  const Message& message() const { return msg_; }
  Router& router() const { return router_; }
  // Keeps the answer for later: the method's return value is then ignored.
  Reply defer_reply();
  bool deferred() const { return deferred_; }
  // The reply state (created on first use); the host answers through it.
  const Reply& reply() ;

 private:
  Router& router_;
  Message msg_;
  Caller caller_;
  std::string service_, method_;
  Payload args_;
  Reply reply_;
  bool deferred_ = false;
};

using Method = std::function<Payload(Request&)>;

class Service {
 public:
  explicit Service(std::string name, RunMode mode = RunMode::kConcurrent);
  virtual ~Service() = default;
  Service(const Service&) = delete;
  Service& operator=(const Service&) = delete;

  const std::string& name() const { return name_; }
  RunMode mode() const { return mode_; }
  // Throws Error on an invalid or duplicate method name. A method that never
  // blocks and takes microseconds (an echo, a status) may be `on_receiver`:
  // in a kConcurrent service it runs on the thread that receives the call
  // (the broker's, for a peer's), saving the hand-off to a worker and back,
  // which costs more than the method. Never for anything that may wait.
  void expose(std::string method, Access access, Method fn, Encoding encoding = Encoding::kRaw,
              bool on_receiver = false);
  // Runs once, after the pool's workers have stopped.
  virtual void on_shutdown() {}

  struct Exposed {
    Access access;
    Method fn;
    Encoding encoding = Encoding::kRaw;
    bool on_receiver = false;
  };
  const Exposed* find(std::string_view method) const;

  // --- host side ---
  // Runs `req` under this service's mode and answers it.
  void run(Request& req, const Exposed& m);
  std::size_t dedup_pending() const;  // computations identical calls may join

 private:
  std::string name_;
  RunMode mode_;
  std::map<std::string, Exposed, std::less<>> methods_;
  // Pending computations, by a hash of method and arguments. An entry holds
  // the arguments as the request does (slices of what was received, no
  // copy), to tell identical calls from a collision.
  struct Computation {
    std::string method;
    Payload args;
    std::weak_ptr<ReplyState> state;
  };
  mutable std::mutex dedup_mu_;
  std::unordered_multimap<std::uint64_t, Computation> dedup_;
};

}  // namespace spindle::services
