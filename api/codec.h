// Codec: how typed calls turn C++ values into bytes and back (msgpack).
//
// spindle::codec<T> is the customization point. The default packs T with
// msgpack-c++'s own adaptors, so every type msgpack knows works as it is:
// integers, floats, bool, std::string, std::vector, std::map, std::optional,
// std::tuple, and structs that declare MSGPACK_DEFINE_MAP(...) (encoded as
// maps, so a Python peer sees dicts). Specialize codec<T> for a type that
// needs another shape:
//
//   template <> struct spindle::codec<Point> {
//     static void encode(spindle::Packer& p, const Point& v) { p.pack(std::tuple{v.x, v.y}); }
//     static Point decode(const msgpack::object& o) { auto [x, y] = o.as<std::tuple<int, int>>(); return {x, y}; }
//   };
//
// Arguments travel as one msgpack array (one element per parameter), a
// result as one value (nil for void). Bytes that are not what the receiving
// side expects raise DecodeError (a tuple, pair or std::array of another
// length too, at any depth: codec_shape.h); nothing is decoded before the whole input
// has been checked to declare no more elements than it has bytes, so a
// hostile 5-byte input cannot make the decoder allocate gigabytes.
//
// A spindle::UniqueFd parameter passes a file descriptor with the call
// (docs/PROTOCOL.md section 13): the fd rides in the message's fd set and the
// argument is its index there (msgpack ext type kFdExtType, one byte; an
// empty UniqueFd is nil). The caller passes a UniqueFd by value (std::move:
// the message takes it and closes it once sent) or as an lvalue (a duplicate
// goes; the caller keeps its own). A raw int does not compile: say
// spindle::dup_fd(fd) to send a copy of an fd owned elsewhere. The callee's
// UniqueFd is its own (a duplicate of the one the message carried, which
// closes with the message). Only top-level parameters carry fds (not a
// UniqueFd inside a struct or a vector), and a result cannot carry one.
//
// Thread safety: pure functions (the fd scopes below are per thread).
#pragma once

#ifndef MSGPACK_NO_BOOST
#define MSGPACK_NO_BOOST 1
#endif

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <msgpack.hpp>

#include <spindle/codec_shape.h>
#include <spindle/errors.h>
#include <spindle/fds.h>
#include <spindle/payload.h>

namespace spindle {

using Packer = msgpack::packer<msgpack::sbuffer>;

template <class T, class Enable = void>
struct codec {
  static void encode(Packer& p, const T& v) { p.pack(v); }
  static T decode(const msgpack::object& o) {
    detail::check_shape<T>(o);  // tuples and arrays of the wrong length (codec_shape.h)
    return o.template as<T>();
  }
};

// The msgpack ext type of an fd argument: its index in the message's fd set.
inline constexpr std::int8_t kFdExtType = 70;  // 'F'
// A Sender (channel.h): ext type 84 whose body is the msgpack array
// [context id, handle], so that a Python peer knows it from a plain pair.
inline constexpr std::int8_t kSenderExtType = 84;
// A padded value: ext type 83 whose body is pad_len:u16 (big-endian), that
// many bytes to skip, then one msgpack value, which is what it decodes as.
// A Python spindle.Buffer is sent as one so that its data start on a page of
// the memfd it travels in (PROTOCOL.md 12.7); only a whole message is padded.
inline constexpr std::int8_t kPaddedExtType = 83;

template <>
struct codec<UniqueFd> {
  static void encode(Packer& p, UniqueFd&& fd);       // the message takes it
  static void encode(Packer& p, const UniqueFd& fd);  // a duplicate goes
  // A duplicate of the fd the message carries (DecodeError if it carries
  // none at that index, or outside a call's decoding).
  static UniqueFd decode(const msgpack::object& o);
};

class Router;

namespace detail {

// The router that decodes Senders on this thread (set while a typed call's
// arguments or result are decoded).
class DecodingScope {
 public:
  explicit DecodingScope(Router& r);
  ~DecodingScope();
  DecodingScope(const DecodingScope&) = delete;
  DecodingScope& operator=(const DecodingScope&) = delete;
  static Router* current();

 private:
  Router* outer_;
};


// Collects the fds of a typed call's arguments while they are encoded.
class FdEncoding {
 public:
  FdEncoding();
  ~FdEncoding();
  FdEncoding(const FdEncoding&) = delete;
  FdEncoding& operator=(const FdEncoding&) = delete;
  static FdEncoding* current();
  // The fd's index in the message (Error past kMaxFdsPerMessage).
  std::uint8_t add(UniqueFd fd);
  std::vector<UniqueFd> take() { return std::move(fds_); }

 private:
  FdEncoding* outer_;
  std::vector<UniqueFd> fds_;
};

// The fd set of the message whose arguments this thread is decoding.
class ReceivedFds {
 public:
  explicit ReceivedFds(const FdSet& fds);
  ~ReceivedFds();
  ReceivedFds(const ReceivedFds&) = delete;
  ReceivedFds& operator=(const ReceivedFds&) = delete;
  static const FdSet* current();

 private:
  const FdSet* outer_;
};

// The context whose call this thread is running (the request's auth_id),
// for an exposed function that must know who called: the Python binding
// unpickles arguments only from its own family.
class CallingContext {
 public:
  explicit CallingContext(std::uint32_t auth_id);
  ~CallingContext();
  CallingContext(const CallingContext&) = delete;
  CallingContext& operator=(const CallingContext&) = delete;
  // The innermost caller on this thread; nullopt outside an exposed call.
  static std::optional<std::uint32_t> current();

 private:
  const CallingContext* outer_;
  std::uint32_t auth_id_;
};

// Takes the buffer's bytes as a Payload without copying them.
Payload payload_of(msgpack::sbuffer&& buf);
// The same, with the fds the arguments carry: fds_of() gives them back (the
// Payload holds them: dropped unsent, it closes them).
Payload payload_of(msgpack::sbuffer&& buf, std::vector<UniqueFd> fds);
FdSet fds_of(const Payload& args);

template <class... A>
inline constexpr bool kCarriesFds = (std::is_same_v<std::decay_t<A>, UniqueFd> || ...);
// Unpacks `bytes` (throws DecodeError when they are not one well-formed
// msgpack value, or declare more elements than they have bytes).
msgpack::object_handle unpack_checked(const Payload& bytes, std::string_view what);
// unpack_checked's input check alone: "" when `bytes` are one msgpack value
// whose containers declare no more elements than there are bytes, else what
// is wrong. For a decoder that unpacks by reference (the Python binding, so
// that a large bin stays in the received mapping instead of being copied).
std::string msgpack_shape_problem(std::span<const std::uint8_t> bytes);
[[noreturn]] void throw_decode_error(std::string_view what, const std::exception& e);

// An argument as the method's parameter type: itself when it already is
// one (no copy; an rvalue stays one, so a UniqueFd can be given up), else
// converted.
template <class D, class X>
decltype(auto) as_param(X&& x) {
  static_assert(!std::is_same_v<D, UniqueFd> || std::is_same_v<std::decay_t<X>, UniqueFd>,
                "spindle: an fd parameter takes a spindle::UniqueFd (std::move it to give it up, "
                "or pass spindle::dup_fd(fd) to send a copy of an fd you keep)");
  if constexpr (std::is_same_v<std::decay_t<X>, D>) return std::forward<X>(x);
  else return D(std::forward<X>(x));
}

template <class... A, class... Args>
Payload encode_args(Args&&... args) {
  static_assert(sizeof...(A) == sizeof...(Args), "wrong number of arguments for this method");
  msgpack::sbuffer buf;
  Packer p(buf);
  if constexpr (kCarriesFds<A...>) {
    FdEncoding fds;
    p.pack_array(sizeof...(A));
    (codec<std::decay_t<A>>::encode(p, as_param<std::decay_t<A>>(std::forward<Args>(args))), ...);
    return payload_of(std::move(buf), fds.take());
  } else {
    p.pack_array(sizeof...(A));
    (codec<std::decay_t<A>>::encode(p, as_param<std::decay_t<A>>(std::forward<Args>(args))), ...);
    return payload_of(std::move(buf));
  }
}

template <class T>
Payload encode_value(const T& v) {
  static_assert(!std::is_same_v<std::decay_t<T>, UniqueFd>,
                "spindle: a result cannot carry an fd; pass fds as arguments (the callee can "
                "call back, or send them as an argument of a call to the caller)");
  msgpack::sbuffer buf;
  Packer p(buf);
  codec<std::decay_t<T>>::encode(p, v);
  return payload_of(std::move(buf));
}

inline Payload encode_void() {
  msgpack::sbuffer buf;
  Packer p(buf);
  p.pack_nil();
  return payload_of(std::move(buf));
}

template <class... A, std::size_t... I>
std::tuple<std::decay_t<A>...> decode_args_at(const msgpack::object& o, std::index_sequence<I...>) {
  return std::tuple<std::decay_t<A>...>{codec<std::decay_t<A>>::decode(o.via.array.ptr[I])...};
}

template <class... A>
std::tuple<std::decay_t<A>...> decode_args(const Payload& bytes) {
  auto h = unpack_checked(bytes, "arguments");
  const msgpack::object& o = h.get();
  if (o.type != msgpack::type::ARRAY || o.via.array.size != sizeof...(A))
    throw DecodeError("arguments: expected an array of " + std::to_string(sizeof...(A)) +
                      " values");
  try {
    return decode_args_at<A...>(o, std::index_sequence_for<A...>{});
  } catch (const DecodeError&) {
    throw;
  } catch (const std::exception& e) {
    throw_decode_error("arguments", e);
  }
}

// A call's result: bytes that do not decode raise a CallError whose type()
// is kDecodeErrorType, as a callee's decode failure does.
template <class R>
R decode_value(const Payload& bytes) {
  static_assert(!std::is_same_v<std::decay_t<R>, UniqueFd>, "spindle: a result cannot carry an fd");
  try {
    auto h = unpack_checked(bytes, "result");
    return codec<std::decay_t<R>>::decode(h.get());
  } catch (const DecodeError& e) {
    throw CallError(kDecodeErrorType, e.what());
  } catch (const std::exception& e) {
    throw CallError(kDecodeErrorType, std::string("result: ") + e.what());
  }
}

}  // namespace detail
}  // namespace spindle
