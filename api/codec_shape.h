// Codec shape check: the array lengths a type fixes, checked before msgpack
// decodes a value as that type.
//
// msgpack-c++ 4.1 reads a std::tuple or std::array whose elements need its
// `as` adaptor (std::wstring, and optionals or containers of one) from the
// back of the array without checking that it has that many elements: a
// one-element array decoded as std::tuple<long, std::wstring> reads before
// the array, out of bounds, and a peer chooses the bytes. Where no `as`
// adaptor is involved it leaves the missing elements default-constructed
// instead, silently. Both are bad input that must be a clear error, so
// codec<T>::decode first walks the value along T: every tuple, pair and
// std::array in it must have exactly its number of elements, at any depth
// under vectors, maps, optionals and the other containers msgpack knows.
// Types with no fixed-size part cost nothing: the walk is generated only
// where T contains one. (A struct's MSGPACK_DEFINE members are converted,
// never read through `as`: no out-of-bounds read there.)
//
// Thread safety: pure functions.
#pragma once

#include <array>
#include <cstddef>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <msgpack.hpp>

#include <spindle/errors.h>

namespace spindle::detail {

// How a type is laid out, as far as the shape check cares.
template <class T>
struct shape {
  static constexpr bool fixed = false;  // contains a fixed-length array somewhere
  static void check(const msgpack::object&) {}
};

template <class T>
inline constexpr bool kHasFixedShape = shape<std::remove_cv_t<T>>::fixed;

template <class T>
void check_shape(const msgpack::object& o) {
  if constexpr (kHasFixedShape<T>) shape<std::remove_cv_t<T>>::check(o);
}

inline void check_array_length(const msgpack::object& o, std::size_t n, const char* what) {
  if (o.type != msgpack::type::ARRAY) throw DecodeError(std::string(what) + ": expected an array");
  if (o.via.array.size != n)
    throw DecodeError(std::string(what) + ": expected an array of " + std::to_string(n) + " values, got " +
                      std::to_string(o.via.array.size));
}

template <class... E>
struct shape<std::tuple<E...>> {
  static constexpr bool fixed = true;
  static void check(const msgpack::object& o) {
    check_array_length(o, sizeof...(E), "a std::tuple");
    check_each(o, std::index_sequence_for<E...>{});
  }
  template <std::size_t... I>
  static void check_each(const msgpack::object& o, std::index_sequence<I...>) {
    (check_shape<E>(o.via.array.ptr[I]), ...);
  }
};

template <class... E>
struct shape<msgpack::type::tuple<E...>> : shape<std::tuple<E...>> {};

template <class A, class B>
struct shape<std::pair<A, B>> {
  static constexpr bool fixed = true;
  static void check(const msgpack::object& o) {
    check_array_length(o, 2, "a std::pair");
    check_shape<A>(o.via.array.ptr[0]);
    check_shape<B>(o.via.array.ptr[1]);
  }
};

template <class E, std::size_t N>
struct shape<std::array<E, N>> {
  static constexpr bool fixed = true;
  static void check(const msgpack::object& o) {
    check_array_length(o, N, "a std::array");
    for (std::size_t i = 0; i < N; ++i) check_shape<E>(o.via.array.ptr[i]);
  }
};

// Containers: each element, when the element type has a fixed part. Anything
// that is not an array is left to msgpack, which refuses it.
template <class E>
struct shape_of_sequence {
  static constexpr bool fixed = kHasFixedShape<E>;
  static void check(const msgpack::object& o) {
    if (o.type != msgpack::type::ARRAY) return;
    for (std::uint32_t i = 0; i < o.via.array.size; ++i) check_shape<E>(o.via.array.ptr[i]);
  }
};
template <class E, class... R>
struct shape<std::vector<E, R...>> : shape_of_sequence<E> {};
template <class E, class... R>
struct shape<std::deque<E, R...>> : shape_of_sequence<E> {};
template <class E, class... R>
struct shape<std::list<E, R...>> : shape_of_sequence<E> {};
template <class E, class... R>
struct shape<std::set<E, R...>> : shape_of_sequence<E> {};
template <class E, class... R>
struct shape<std::multiset<E, R...>> : shape_of_sequence<E> {};
template <class E, class... R>
struct shape<std::unordered_set<E, R...>> : shape_of_sequence<E> {};
template <class E, class... R>
struct shape<std::unordered_multiset<E, R...>> : shape_of_sequence<E> {};

template <class K, class V>
struct shape_of_map {
  static constexpr bool fixed = kHasFixedShape<K> || kHasFixedShape<V>;
  static void check(const msgpack::object& o) {
    if (o.type != msgpack::type::MAP) return;
    for (std::uint32_t i = 0; i < o.via.map.size; ++i) {
      check_shape<K>(o.via.map.ptr[i].key);
      check_shape<V>(o.via.map.ptr[i].val);
    }
  }
};
template <class K, class V, class... R>
struct shape<std::map<K, V, R...>> : shape_of_map<K, V> {};
template <class K, class V, class... R>
struct shape<std::multimap<K, V, R...>> : shape_of_map<K, V> {};
template <class K, class V, class... R>
struct shape<std::unordered_map<K, V, R...>> : shape_of_map<K, V> {};
template <class K, class V, class... R>
struct shape<std::unordered_multimap<K, V, R...>> : shape_of_map<K, V> {};

// Nil is "none"; anything else is the value.
template <class E>
struct shape_of_nullable {
  static constexpr bool fixed = kHasFixedShape<E>;
  static void check(const msgpack::object& o) {
    if (o.type != msgpack::type::NIL) check_shape<E>(o);
  }
};
template <class E>
struct shape<std::optional<E>> : shape_of_nullable<E> {};
template <class E>
struct shape<std::shared_ptr<E>> : shape_of_nullable<E> {};
template <class E>
struct shape<std::unique_ptr<E>> : shape_of_nullable<E> {};

}  // namespace spindle::detail
