// Errors: the exceptions Spindle raises to callers, and their named texts.
//
// Expected outcomes that a caller handles in the normal course (EOF, a full
// queue seen by the broker itself) are results, not exceptions. These types are
// for what reaches user code: a call that failed remotely (CallError), a dead
// reply (ChannelError), a deadline (TimeoutError), use after shutdown
// (ShutdownError) and a full output queue under the fail policy (QueueFullError).
//
// Thread safety: plain value types.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace spindle {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The broker no longer accepts work: defer()/send() after shutdown completed.
class ShutdownError : public Error {
 public:
  using Error::Error;
};

// The message could not be delivered; what() is the reason a router gave in
// its dead reply (Mitogen's ChannelError).
class ChannelError : public Error {
 public:
  using Error::Error;
};

// The remote handler threw. type() names the exception type, what() is
// "type: message".
class CallError : public Error {
 public:
  CallError(std::string type, std::string message)
      : Error(type + ": " + message), type_(std::move(type)), message_(std::move(message)) {}
  const std::string& type() const { return type_; }
  const std::string& message() const { return message_; }

 private:
  std::string type_;
  std::string message_;
};

class TimeoutError : public Error {
 public:
  using Error::Error;
};

class QueueFullError : public Error {
 public:
  using Error::Error;
};

// errno's description without strerror()'s locale lookup, which takes a lock
// that a fork() could leave held in the child.
const char* errno_text(int err);

// Named texts, so tests and peers can match on them.
namespace errtext {
inline constexpr std::string_view kBrokerShutDown = "broker has shut down; the request was not accepted";
inline constexpr std::string_view kCallTimedOut = "call timed out";
}  // namespace errtext

}  // namespace spindle
