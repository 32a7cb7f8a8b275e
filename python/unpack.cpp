// msgpack -> Python values: the way back of convert.cpp (docs/PROTOCOL.md
// 12.6, 12.7).
//
// Decoding walks the input once first (detail::msgpack_shape_problem), so
// hostile bytes cannot make it allocate much, then unpacks by reference
// (bin, str and ext not copied): a large bin, an ndarray (ext 81) and the
// buffers of an out-of-band pickle (ext 82) are read-only views of the
// received message, the memfd's mapping when it came as one. A padded value
// (ext 83, a spindle.Buffer) is the value after its pad; a Sender (ext 84)
// is bound to the router unpacking it (decode()'s port, which
// decoding_port() gives while the decode runs).
// Thread: the caller holds the GIL.
#include "binding.h"

#include <span>
#include <string>
#include <utility>

#include <spindle/codec.h>
#include <spindle/frame.h>

namespace spindle::python {
namespace {

// The port a Sender decoded on this thread sends through (borrowed: the
// caller of decode() holds it for the whole decode). A Sender may also come
// out of a pickle, which pickle.loads builds through
// spindle._messages._sender, so the port cannot be an argument: _sender asks
// decoding_port().
thread_local PyObject* t_decoding_port = nullptr;

class PortScope {
 public:
  explicit PortScope(py::handle port) : outer_(t_decoding_port) { t_decoding_port = port.ptr(); }
  ~PortScope() { t_decoding_port = outer_; }
  PortScope(const PortScope&) = delete;
  PortScope& operator=(const PortScope&) = delete;

 private:
  PyObject* outer_;
};

// The unpickler of one decode: the one given (pickle.loads, a function that
// refuses, or None), or the one a _PickleTrust gives for the sender, asked
// only when the first pickle comes: most values carry none, and asking is a
// Python call.
class Unpickler {
 public:
  explicit Unpickler(py::handle given) : fn_(py::reinterpret_borrow<py::object>(given)) {}
  Unpickler(py::handle trust, py::handle sender) : trust_(trust), sender_(sender) {}

  template <class... Args>
  py::object operator()(Args&&... args) {
    if (!fn_) fn_ = trust_.attr("unpickler")(sender_);
    return fn_(std::forward<Args>(args)...);
  }

 private:
  py::object fn_;
  py::handle trust_, sender_;
};

// An ext 81 body (see pack_ndarray) as a read-only numpy array over `src`.
py::object unpack_ndarray(const Payload& src, const msgpack::object_ext& ext) {
  const auto* body = reinterpret_cast<const std::uint8_t*>(ext.data());
  const std::size_t n = ext.size;
  auto bad = [] { return py::value_error("spindle: received a malformed numpy array (ext type 81)"); };
  if (n < 2) throw bad();
  const std::size_t hlen = (std::size_t{body[0]} << 8) | body[1];
  if (hlen > n - 2) throw bad();
  std::string_view header(reinterpret_cast<const char*>(body + 2), hlen);
  if (!detail::msgpack_shape_problem({body + 2, hlen}).empty()) throw bad();
  msgpack::object_handle h = msgpack::unpack(header.data(), header.size());
  const msgpack::object& o = h.get();
  if (o.type != msgpack::type::ARRAY || o.via.array.size != 2 || o.via.array.ptr[0].type != msgpack::type::STR ||
      o.via.array.ptr[1].type != msgpack::type::ARRAY)
    throw bad();
  const auto& d = o.via.array.ptr[0].via.str;
  const auto& dims = o.via.array.ptr[1].via.array;
  py::tuple shape(dims.size);
  for (std::uint32_t i = 0; i < dims.size; ++i) {
    if (dims.ptr[i].type != msgpack::type::POSITIVE_INTEGER) throw bad();
    shape[i] = py::int_(dims.ptr[i].via.u64);
  }
  py::module_ np = py::module_::import("numpy");
  py::object dtype = np.attr("dtype")(py::str(d.ptr, d.size));
  if (dtype.attr("hasobject").cast<bool>()) throw bad();  // pointers from another process
  // frombuffer checks that the bytes are a whole number of items; reshape,
  // that they are exactly the shape's. Neither copies.
  py::memoryview mv = view_of(src, body + 2 + hlen, n - 2 - hlen);
  return np.attr("frombuffer")(mv, dtype).attr("reshape")(shape);
}

// An ext 82 body (see pack_pickled_out_of_band): unpickler(bytes,
// buffers=[read-only memoryviews of the message]).
py::object unpack_pickled_out_of_band(const Payload& src, const msgpack::object_ext& ext, Unpickler& unpickler) {
  const auto* body = reinterpret_cast<const std::uint8_t*>(ext.data());
  auto bad = [] { return py::value_error("spindle: received a malformed out-of-band pickle (ext type 82)"); };
  if (!detail::msgpack_shape_problem({body, ext.size}).empty()) throw bad();
  msgpack::object_handle h = msgpack::unpack(reinterpret_cast<const char*>(body), ext.size,
                                             [](msgpack::type::object_type, std::size_t, void*) { return true; });
  const msgpack::object& o = h.get();
  if (o.type != msgpack::type::ARRAY || o.via.array.size < 1) throw bad();
  for (std::uint32_t i = 0; i < o.via.array.size; ++i)
    if (o.via.array.ptr[i].type != msgpack::type::BIN) throw bad();
  const auto& data = o.via.array.ptr[0].via.bin;
  py::list buffers;
  for (std::uint32_t i = 1; i < o.via.array.size; ++i) {
    const auto& bin = o.via.array.ptr[i].via.bin;
    buffers.append(view_of(src, reinterpret_cast<const std::uint8_t*>(bin.ptr), bin.size));
  }
  return unpickler(py::bytes(data.ptr, data.size), py::arg("buffers") = buffers);
}

py::object unpack_object(const Payload& src, const msgpack::object& o, Unpickler& unpickler, int depth);

// Unpacks exactly one msgpack value that fills `bytes` (inside `src`), by
// reference: bin, str and ext point into `src`.
py::object unpack_in(const Payload& src, std::span<const std::uint8_t> bytes, Unpickler& unpickler, int depth) {
  std::string problem = detail::msgpack_shape_problem(bytes);
  if (!problem.empty())
    throw py::value_error("spindle: received bytes that are not msgpack: value: not one msgpack value (" +
                          problem + ")");
  msgpack::object_handle h;
  try {
    h = msgpack::unpack(reinterpret_cast<const char*>(bytes.data()), bytes.size(),
                        [](msgpack::type::object_type, std::size_t, void*) { return true; });
  } catch (const std::exception& e) {
    throw py::value_error(std::string("spindle: received bytes that are not msgpack: ") + e.what());
  }
  return unpack_object(src, h.get(), unpickler, depth);
}

// An ext 83 body (kPaddedExtType): the value after the pad.
py::object unpack_padded(const Payload& src, const msgpack::object_ext& ext, Unpickler& unpickler, int depth) {
  const auto* body = reinterpret_cast<const std::uint8_t*>(ext.data());
  const std::size_t pad = ext.size < 2 ? 0 : (std::size_t{body[0]} << 8) | body[1];
  if (ext.size < 2 || pad > ext.size - 2)
    throw py::value_error("spindle: received a malformed padded value (ext type 83)");
  return unpack_in(src, {body + 2 + pad, ext.size - 2 - pad}, unpickler, depth + 1);
}

// An ext 84 body: a spindle.Sender bound to the router unpacking it.
py::object unpack_sender(const msgpack::object_ext& ext) {
  const auto* body = reinterpret_cast<const std::uint8_t*>(ext.data());
  auto bad = [] { return py::value_error("spindle: received a malformed Sender (ext type 84)"); };
  if (!detail::msgpack_shape_problem({body, ext.size}).empty()) throw bad();
  msgpack::object_handle h = msgpack::unpack(ext.data(), ext.size);
  const msgpack::object& o = h.get();
  if (o.type != msgpack::type::ARRAY || o.via.array.size != 2) throw bad();
  for (std::uint32_t i = 0; i < 2; ++i)
    if (o.via.array.ptr[i].type != msgpack::type::POSITIVE_INTEGER || o.via.array.ptr[i].via.u64 > UINT32_MAX)
      throw bad();
  const auto handle = static_cast<std::uint32_t>(o.via.array.ptr[1].via.u64);
  if (!is_sender_handle(handle))  // api/frame.h: never a control or reply handle
    throw py::value_error("spindle: received a Sender of handle " + std::to_string(handle) +
                          ", which no receiver holds (a control or reply handle)");
  return py::module_::import("spindle._messages")
      .attr("_sender")(o.via.array.ptr[0].via.u64, o.via.array.ptr[1].via.u64);
}

// Map keys are scalars, as msgpack-python's strict_map_key (str and bytes)
// allows and a little more. A tuple's hash is a fixed function of its items'
// hashes, so a peer can send thousands of keys that all collide: each insert
// then compares against every earlier one (an audit: a 607 KB map kept a
// receiver busy 13 s, the GIL held). str and bytes hashes are keyed per
// process; an int's or a float's is its value modulo 2^61-1, and the 64-bit
// ints and the floats that share one are a few dozen at most.
bool is_scalar_key(const msgpack::object& k) {
  switch (k.type) {
    case msgpack::type::NIL:
    case msgpack::type::BOOLEAN:
    case msgpack::type::POSITIVE_INTEGER:
    case msgpack::type::NEGATIVE_INTEGER:
    case msgpack::type::FLOAT32:
    case msgpack::type::FLOAT64:
    case msgpack::type::STR:
    case msgpack::type::BIN: return true;
    default: return false;
  }
}

const char* type_name(const msgpack::object& o) {
  switch (o.type) {
    case msgpack::type::ARRAY: return "array";
    case msgpack::type::MAP: return "map";
    case msgpack::type::EXT: return "ext";
    default: return "scalar";
  }
}

py::object unpack_object(const Payload& src, const msgpack::object& o, Unpickler& unpickler, int depth) {
  if (depth > kMaxDepth) throw py::value_error("spindle: received value nested too deeply");
  switch (o.type) {
    case msgpack::type::NIL: return py::none();
    case msgpack::type::BOOLEAN: return py::bool_(o.via.boolean);
    case msgpack::type::POSITIVE_INTEGER: return py::reinterpret_steal<py::object>(PyLong_FromUnsignedLongLong(o.via.u64));
    case msgpack::type::NEGATIVE_INTEGER: return py::reinterpret_steal<py::object>(PyLong_FromLongLong(o.via.i64));
    case msgpack::type::FLOAT32:
    case msgpack::type::FLOAT64: return py::float_(o.via.f64);
    case msgpack::type::STR: return py::str(o.via.str.ptr, o.via.str.size);
    case msgpack::type::BIN:
      if (o.via.bin.size >= kOutOfBandMin)  // a view of the message (the memfd's mapping)
        return view_of(src, reinterpret_cast<const std::uint8_t*>(o.via.bin.ptr), o.via.bin.size);
      return py::bytes(o.via.bin.ptr, o.via.bin.size);
    case msgpack::type::ARRAY: {
      py::list l(o.via.array.size);
      for (std::uint32_t i = 0; i < o.via.array.size; ++i)
        l[i] = unpack_object(src, o.via.array.ptr[i], unpickler, depth + 1);
      return l;
    }
    case msgpack::type::MAP: {
      py::dict d;
      for (std::uint32_t i = 0; i < o.via.map.size; ++i) {
        const msgpack::object& key = o.via.map.ptr[i].key;
        if (!is_scalar_key(key))
          throw py::value_error(std::string("spindle: received a map key of msgpack type ") + type_name(key) +
                                "; a map's keys are nil, bool, int, float, str or bin");
        py::object k = unpack_object(src, key, unpickler, depth + 1);
        d[k] = unpack_object(src, o.via.map.ptr[i].val, unpickler, depth + 1);
      }
      return d;
    }
    case msgpack::type::EXT:
      if (o.via.ext.type() == kPickleExtType)
        return unpickler(py::bytes(o.via.ext.data(), o.via.ext.size));
      if (o.via.ext.type() == kNdarrayExtType) return unpack_ndarray(src, o.via.ext);
      if (o.via.ext.type() == kPickleOutOfBandExtType) return unpack_pickled_out_of_band(src, o.via.ext, unpickler);
      if (o.via.ext.type() == kPaddedExtType) return unpack_padded(src, o.via.ext, unpickler, depth);
      if (o.via.ext.type() == kSenderExtType) return unpack_sender(o.via.ext);
      throw py::value_error("spindle: received msgpack ext type " +
                            std::to_string(static_cast<int>(o.via.ext.type())) +
                            ", which Python does not take");
  }
  throw py::value_error("spindle: received a msgpack value of unknown type");
}

// Unpacked by reference: bin, str and ext point into `src`, so a large bin
// becomes a view of the received bytes. They must be one range for that; a
// message in several slices is joined once (a memfd body never is).
py::object unpack_whole(const Payload& bytes, Unpickler& unpickler) {
  Payload src = bytes.contiguous().size() == bytes.size() ? bytes : bytes.owned_copy();
  return unpack_in(src, src.contiguous(), unpickler, 0);
}

}  // namespace

py::object unpack(const Payload& bytes, py::handle unpickler) {
  Unpickler u(unpickler);
  return unpack_whole(bytes, u);
}

py::object decode(const Payload& bytes, py::handle trust, py::handle sender, py::handle port) {
  PortScope scope(port);
  Unpickler u(trust, sender);
  return unpack_whole(bytes, u);
}

py::object decoding_port() {
  return t_decoding_port ? py::reinterpret_borrow<py::object>(t_decoding_port) : py::none();
}

}  // namespace spindle::python
