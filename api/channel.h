// Sender<T> and Receiver<T>: streams of typed messages, without handle
// numbers picked by hand.
//
//   spindle::Receiver<long> rx(rt);              // or a ChildEnv, a Connection
//   child.call(count_to, rx.sender(), 5L);       // a Sender travels as an argument
//   long first = rx.receive();                   // blocks; in arrival order
//
// A Receiver registers a fresh handle on its context's router; its Sender
// names (context, handle) and encodes each value with msgpack (codec.h).
// What waits in a Receiver stays charged to the peer that sent it (its
// bytes sit in that peer's receive chunks, PROTOCOL.md section 14), so a
// receiver that does not keep up slows its senders instead of growing.
// A Sender is encoded as ext 84 around [context id, handle] (a Python peer's
// spindle.Sender is the same); decoded inside an exposed
// function's arguments or a call's result, it sends through the runtime
// that decoded it.
//
// Thread safety: send() from any thread; receive() from any thread (each
// value goes to one receiver). Ownership: a Receiver owns its handle and
// gives it back when destroyed (later messages to it: "invalid handle"); it
// refers to its router through the router's link, so a Receiver that
// outlives its runtime throws ShutdownError.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include <spindle/codec.h>
#include <spindle/context.h>
#include <spindle/errors.h>
#include <spindle/frame.h>
#include <spindle/payload.h>

namespace spindle {

namespace detail {

class ReceiverCore {
 public:
  explicit ReceiverCore(Router& router);
  ~ReceiverCore();
  ReceiverCore(const ReceiverCore&) = delete;
  ReceiverCore& operator=(const ReceiverCore&) = delete;

  // This context, and the handle values arrive on.
  Context self() const { return self_; }
  std::uint32_t handle() const { return handle_; }
  // Blocks for the next payload; ShutdownError once the runtime is gone.
  Payload receive();
  std::optional<Payload> receive_for(std::chrono::milliseconds timeout);

 private:
  struct State;
  std::shared_ptr<State> st_;
  Context self_;
  std::uint32_t handle_ = 0;
};

}  // namespace detail

template <class T>
class Sender {
 public:
  Sender() = default;
  Sender(Context to, std::uint32_t handle) : to_(std::move(to)), handle_(handle) {}
  void send(const T& value) const { to_.send(handle_, detail::encode_value(value)); }
  const Context& context() const { return to_; }
  std::uint32_t handle() const { return handle_; }

 private:
  Context to_;
  std::uint32_t handle_ = 0;
};

template <class T>
class Receiver {
 public:
  // `host` is what owns the router: a Runtime, a ChildEnv or a Connection.
  template <class Host>
  explicit Receiver(Host& host) : core_(std::make_unique<detail::ReceiverCore>(host.router())) {}

  T receive() { return decode(core_->receive()); }
  std::optional<T> receive_for(std::chrono::milliseconds timeout) {
    if (auto p = core_->receive_for(timeout)) return decode(*p);
    return std::nullopt;
  }
  Sender<T> sender() const { return Sender<T>(core_->self(), core_->handle()); }

 private:
  T decode(const Payload& p) {
    detail::DecodingScope scope(core_->self().router());
    return detail::decode_value<T>(p);
  }
  std::unique_ptr<detail::ReceiverCore> core_;
};

// A Sender travels as ext type kSenderExtType around [context id, handle]
// (a Python peer makes it a spindle.Sender); the bare array, its form
// before, is still read.
template <class T>
struct codec<Sender<T>> {
  static void encode(Packer& p, const Sender<T>& s) {
    msgpack::sbuffer body;
    Packer bp(body);
    bp.pack_array(2);
    bp.pack(s.context().id());
    bp.pack(s.handle());
    p.pack_ext(body.size(), kSenderExtType);
    p.pack_ext_body(body.data(), body.size());
  }
  static Sender<T> decode(const msgpack::object& o) {
    Router* r = detail::DecodingScope::current();
    if (!r) throw DecodeError("a Sender decodes only inside a Spindle call or receive");
    if (o.type == msgpack::type::EXT && o.via.ext.type() == kSenderExtType) {
      std::string problem = detail::msgpack_shape_problem(
          {reinterpret_cast<const std::uint8_t*>(o.via.ext.data()), o.via.ext.size});
      if (!problem.empty()) throw DecodeError("a Sender: not one msgpack value (" + problem + ")");
      msgpack::object_handle h = msgpack::unpack(o.via.ext.data(), o.via.ext.size);
      return decode_pair(*r, h.get());
    }
    return decode_pair(*r, o);
  }

 private:
  static Sender<T> decode_pair(Router& r, const msgpack::object& o) {
    if (o.type != msgpack::type::ARRAY || o.via.array.size != 2)
      throw DecodeError("a Sender is [context id, handle]");
    const auto handle = o.via.array.ptr[1].as<std::uint32_t>();
    if (!is_sender_handle(handle))
      throw DecodeError("a Sender names handle " + std::to_string(handle) +
                        ", which no Receiver holds (a control or reply handle)");
    return Sender<T>(Context(r, o.via.array.ptr[0].as<std::uint32_t>(), "sender"), handle);
  }
};

}  // namespace spindle
