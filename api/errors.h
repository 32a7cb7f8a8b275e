// Errors: the exceptions Spindle raises to callers.
//
// Expected outcomes that a caller handles in the normal course (EOF, a full
// queue seen by the broker itself) are results, not exceptions. These types
// are for what reaches user code: a call that failed remotely (CallError), a
// dead reply (ChannelError), a deadline (TimeoutError), use after shutdown
// (ShutdownError), a full output queue under the fail policy
// (QueueFullError) and bytes that are not what a typed call expects
// (DecodeError).
//
// Thread safety: plain value types.
#pragma once

#include <stdexcept>
#include <string>

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
// "type: message". A handler or exposed function that throws a CallError
// answers with its type() and message() (to name another language's
// exception, or pass on a failure it was told of); any other exception
// answers with its C++ type and what().
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

// Bytes that do not decode as the type a typed call expects (its arguments
// on the callee's side, its result on the caller's). A callee's DecodeError
// reaches the caller as a CallError whose type() is kDecodeErrorType.
class DecodeError : public Error {
 public:
  using Error::Error;
};
inline constexpr const char* kDecodeErrorType = "spindle::DecodeError";

}  // namespace spindle
