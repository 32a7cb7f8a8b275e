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
// side expects raise DecodeError; nothing is decoded before the whole input
// has been checked to declare no more elements than it has bytes, so a
// hostile 5-byte input cannot make the decoder allocate gigabytes.
//
// Thread safety: pure functions.
#pragma once

#ifndef MSGPACK_NO_BOOST
#define MSGPACK_NO_BOOST 1
#endif

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include <msgpack.hpp>

#include <spindle/errors.h>
#include <spindle/payload.h>

namespace spindle {

using Packer = msgpack::packer<msgpack::sbuffer>;

template <class T, class Enable = void>
struct codec {
  static void encode(Packer& p, const T& v) { p.pack(v); }
  static T decode(const msgpack::object& o) { return o.template as<T>(); }
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


// Takes the buffer's bytes as a Payload without copying them.
Payload payload_of(msgpack::sbuffer&& buf);
// Unpacks `bytes` (throws DecodeError when they are not one well-formed
// msgpack value, or declare more elements than they have bytes).
msgpack::object_handle unpack_checked(const Payload& bytes, std::string_view what);
[[noreturn]] void throw_decode_error(std::string_view what, const std::exception& e);

// An argument as the method's parameter type: itself when it already is
// one (no copy), else converted.
template <class D, class X>
decltype(auto) as_param(X&& x) {
  if constexpr (std::is_same_v<std::decay_t<X>, D>) return static_cast<const D&>(x);
  else return D(std::forward<X>(x));
}

template <class... A, class... Args>
Payload encode_args(Args&&... args) {
  static_assert(sizeof...(A) == sizeof...(Args), "wrong number of arguments for this method");
  msgpack::sbuffer buf;
  Packer p(buf);
  p.pack_array(sizeof...(A));
  (codec<std::decay_t<A>>::encode(p, as_param<std::decay_t<A>>(std::forward<Args>(args))), ...);
  return payload_of(std::move(buf));
}

template <class T>
Payload encode_value(const T& v) {
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
