// Python values <-> the msgpack of typed calls (docs/PROTOCOL.md 12.6).
//
// The mapping is msgpack's usual one, so that a C++ peer's codec<T> reads
// what Python sends: None nil, bool, int (64-bit), float (float64), str, bytes
// (bytearray and memoryview too) bin, list and tuple array, dict map. What
// has __index__ (numpy's integers) is an int, a float subclass
// (numpy.float64) a float. What does not fit (a set, an instance, an int
// beyond 64 bits) is pickled into ext type 80 when a pickler is given; a
// receiver decides whether it accepts pickle (see the package).
// Large values (kOutOfBandMin and up, PROTOCOL 12.7): a buffer is a bin and a
// numpy array ext type 81 whose bytes are the exporter's own memory, a slice
// of the Payload (buffers.cpp), never copied into the msgpack bytes; on
// receipt they are read-only views of the message. Decoding walks the input
// once first (detail::msgpack_shape_problem), so hostile bytes cannot make it
// allocate much, then unpacks by reference (bin, str and ext not copied).
// Thread: the caller holds the GIL.
#include "binding.h"

#include <cstring>
#include <span>
#include <string>
#include <vector>

#include <spindle/codec.h>

namespace spindle::python {
namespace {

// Deep enough for any sane argument; deeper is a reference cycle or an
// attack, and recursion must stay within the C stack.
constexpr int kMaxDepth = 512;

void pack_into(Packer& p, PayloadBuilder& b, py::handle obj, py::handle pickler, int depth);

std::size_t bin_header_size(std::size_t n) { return n <= 0xff ? 2 : n <= 0xffff ? 3 : 5; }
std::size_t array_header_size(std::size_t n) { return n <= 15 ? 1 : n <= 0xffff ? 3 : 5; }

// Pickle protocol 5 with out-of-band buffers (the pickler returned
// (bytes, [PickleBuffer...])): ext type 82 whose body is the msgpack array
// [pickle bytes, buffer...], each a bin; the buffers are slices of the
// Payload, as a large bin is, so a numpy array inside an object is not
// copied into the message either.
void pack_pickled_out_of_band(Packer& p, PayloadBuilder& b, py::bytes data, py::list buffers) {
  std::string_view s = data;
  std::vector<py::object> views;
  std::size_t body = array_header_size(buffers.size() + 1) + bin_header_size(s.size()) + s.size();
  for (py::handle pb : buffers) {
    py::object mv = py::reinterpret_steal<py::object>(PyMemoryView_FromObject(pb.ptr()));
    if (!mv) throw py::error_already_set();
    Py_buffer* v = PyMemoryView_GET_BUFFER(mv.ptr());
    if (!PyBuffer_IsContiguous(v, 'C'))
      throw py::value_error("spindle: an out-of-band pickle buffer is not contiguous");
    const auto n = static_cast<std::size_t>(v->len);
    if (n > UINT32_MAX) throw py::value_error("spindle: a pickle buffer above 4 GiB cannot travel as msgpack bin");
    body += bin_header_size(n) + n;
    views.push_back(std::move(mv));
  }
  if (body > UINT32_MAX) throw py::value_error("spindle: a pickled value above 4 GiB cannot travel as one msgpack ext");
  p.pack_ext(static_cast<std::uint32_t>(body), kPickleOutOfBandExtType);
  p.pack_array(static_cast<std::uint32_t>(views.size() + 1));
  p.pack_bin(static_cast<std::uint32_t>(s.size()));
  p.pack_bin_body(s.data(), static_cast<std::uint32_t>(s.size()));
  for (py::object& mv : views) {
    Py_buffer* v = PyMemoryView_GET_BUFFER(mv.ptr());
    p.pack_bin(static_cast<std::uint32_t>(v->len));
    b.attach(mv, v->buf, static_cast<std::size_t>(v->len));
  }
}

void pack_pickled(Packer& p, PayloadBuilder& b, py::handle obj, py::handle pickler) {
  if (pickler.is_none())
    throw py::type_error(std::string("spindle: cannot send a value of type ") +
                         std::string(py::str(py::type::handle_of(obj).attr("__qualname__"))) +
                         " as msgpack, and pickle is off for this call");
  py::object r = pickler(obj);
  if (py::isinstance<py::tuple>(r)) {
    auto t = r.cast<py::tuple>();
    return pack_pickled_out_of_band(p, b, t[0].cast<py::bytes>(), t[1].cast<py::list>());
  }
  std::string_view s = r.cast<py::bytes>();
  p.pack_ext(s.size(), kPickleExtType);
  p.pack_ext_body(s.data(), s.size());
}

// A C-contiguous buffer of at least kOutOfBandMin bytes as a bin whose body
// is the exporter's own memory (a slice of the Payload, not a copy); false
// when it is smaller, so the caller packs it as before.
bool pack_large_buffer(Packer& p, PayloadBuilder& b, py::handle obj) {
  py::object mv = py::reinterpret_steal<py::object>(PyMemoryView_FromObject(obj.ptr()));
  if (!mv) throw py::error_already_set();
  Py_buffer* view = PyMemoryView_GET_BUFFER(mv.ptr());
  if (static_cast<std::size_t>(view->len) < kOutOfBandMin) return false;
  if (!PyBuffer_IsContiguous(view, 'C')) {
    // A strided view: one copy into a contiguous bytes object, then as above.
    mv = py::reinterpret_steal<py::object>(PyBytes_FromObject(obj.ptr()));
    if (!mv) throw py::error_already_set();
    return pack_large_buffer(p, b, mv);
  }
  if (static_cast<std::size_t>(view->len) > UINT32_MAX)
    throw py::value_error("spindle: a buffer above 4 GiB cannot travel as msgpack bin");
  p.pack_bin(static_cast<std::uint32_t>(view->len));
  b.attach(mv, view->buf, static_cast<std::size_t>(view->len));
  return true;
}

// spindle.Buffer inside a larger value: its inner value, whose data are a
// slice of its sealed memfd (copied once more into the message's memfd).
bool pack_fabric_buffer(PayloadBuilder& b, py::handle obj) {
  if (!py::isinstance<FabricBuffer>(obj)) return false;
  auto& fb = obj.cast<FabricBuffer&>();
  const std::uint8_t* data = fb.sealed_data();
  b.buffer().write(fb.inner_prefix().data(), fb.inner_prefix().size());
  b.attach(obj, data, fb.size());
  return true;
}

// A spindle.Sender as ext 84 around [context id, handle] (api/codec.h),
// which a C++ peer decodes as a spindle::Sender<T>. Its class is looked up
// where the package put it; before that module is imported, no Sender exists.
bool pack_sender(Packer& p, py::handle obj) {
  PyObject* mod = PyImport_GetModule(py::str("spindle._messages").ptr());
  if (!mod) {
    if (PyErr_Occurred()) throw py::error_already_set();
    return false;
  }
  py::object messages = py::reinterpret_steal<py::object>(mod);
  if (!py::isinstance(obj, messages.attr("Sender"))) return false;
  msgpack::sbuffer body;
  Packer bp(body);
  bp.pack_array(2);
  bp.pack_uint32(obj.attr("context_id").cast<std::uint32_t>());
  bp.pack_uint32(obj.attr("handle").cast<std::uint32_t>());
  p.pack_ext(body.size(), kSenderExtType);
  p.pack_ext_body(body.data(), body.size());
  return true;
}

// A numpy array of at least kOutOfBandMin bytes (and no Python objects in
// it) as ext type 81: its dtype and shape, then its bytes out of band. Not
// for smaller ones, which keep their old form (pickle, ext 80), nor when
// numpy was never imported (then there is no array).
bool pack_ndarray(PayloadBuilder& b, py::handle obj) {
  PyObject* numpy = PyImport_GetModule(py::str("numpy").ptr());
  if (!numpy) {
    if (PyErr_Occurred()) throw py::error_already_set();
    return false;
  }
  py::object np = py::reinterpret_steal<py::object>(numpy);
  if (!py::isinstance(obj, np.attr("ndarray"))) return false;
  if (obj.attr("nbytes").cast<std::size_t>() < kOutOfBandMin || obj.attr("dtype").attr("hasobject").cast<bool>())
    return false;
  py::object arr = np.attr("ascontiguousarray")(obj);  // itself when it already is
  py::object mv = py::reinterpret_steal<py::object>(PyMemoryView_FromObject(arr.ptr()));
  if (!mv) throw py::error_already_set();
  Py_buffer* view = PyMemoryView_GET_BUFFER(mv.ptr());
  const std::size_t n = static_cast<std::size_t>(view->len);
  std::string prefix = ndarray_prefix(py::str(arr.attr("dtype").attr("str")), arr.attr("shape"), n);
  b.buffer().write(prefix.data(), prefix.size());
  b.attach(mv, view->buf, n);
  return true;
}

void pack_into(Packer& p, PayloadBuilder& b, py::handle obj, py::handle pickler, int depth) {
  if (depth > kMaxDepth) throw py::value_error("spindle: value nested too deeply to send");
  PyObject* o = obj.ptr();
  if (o == Py_None) {
      p.pack_nil();
      return;
    }
  if (PyBool_Check(o)) {
    o == Py_True ? p.pack_true() : p.pack_false();
    return;
  }
  if (PyLong_CheckExact(o) || (PyLong_Check(o) && !PyBool_Check(o))) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow == 0) {
      if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
      {
      p.pack_int64(v);
      return;
    }
    }
    if (overflow > 0) {
      unsigned long long u = PyLong_AsUnsignedLongLong(o);
      if (!(u == static_cast<unsigned long long>(-1) && PyErr_Occurred())) {
      p.pack_uint64(u);
      return;
    }
      PyErr_Clear();
    }
    return pack_pickled(p, b, obj, pickler);  // beyond 64 bits
  }
  if (PyFloat_Check(o)) {
      p.pack_double(PyFloat_AS_DOUBLE(o));
      return;
    }
  if (PyUnicode_Check(o)) {
    Py_ssize_t n = 0;
    const char* s = PyUnicode_AsUTF8AndSize(o, &n);
    if (!s) throw py::error_already_set();
    p.pack_str(static_cast<std::uint32_t>(n));
    {
      p.pack_str_body(s, static_cast<std::uint32_t>(n));
      return;
    }
  }
  if (PyBytes_Check(o)) {
    if (static_cast<std::size_t>(PyBytes_GET_SIZE(o)) > UINT32_MAX)
      throw py::value_error("spindle: bytes above 4 GiB cannot travel as msgpack bin");
    p.pack_bin(static_cast<std::uint32_t>(PyBytes_GET_SIZE(o)));
    if (static_cast<std::size_t>(PyBytes_GET_SIZE(o)) >= kOutOfBandMin) {
      b.attach(obj, PyBytes_AS_STRING(o), static_cast<std::size_t>(PyBytes_GET_SIZE(o)));
      return;
    }
    {
      p.pack_bin_body(PyBytes_AS_STRING(o), static_cast<std::uint32_t>(PyBytes_GET_SIZE(o)));
      return;
    }
  }
  if (PyByteArray_Check(o) || PyMemoryView_Check(o)) {
    if (pack_large_buffer(p, b, obj)) return;
    Py_buffer view;
    if (PyObject_GetBuffer(o, &view, PyBUF_C_CONTIGUOUS) != 0) throw py::error_already_set();
    struct Release {
      Py_buffer* v;
      ~Release() { PyBuffer_Release(v); }
    } release{&view};
    if (static_cast<std::size_t>(view.len) > UINT32_MAX)
      throw py::value_error("spindle: a buffer above 4 GiB cannot travel as msgpack bin");
    auto n = static_cast<std::uint32_t>(view.len);
    p.pack_bin(n);
    p.pack_bin_body(static_cast<const char*>(view.buf), n);
    return;
  }
  if (PyList_Check(o) || PyTuple_Check(o)) {
    py::sequence seq = py::reinterpret_borrow<py::sequence>(obj);
    p.pack_array(static_cast<std::uint32_t>(seq.size()));
    for (py::handle item : seq) pack_into(p, b, item, pickler, depth + 1);
    return;
  }
  if (PyDict_Check(o)) {
    py::dict d = py::reinterpret_borrow<py::dict>(obj);
    p.pack_map(static_cast<std::uint32_t>(d.size()));
    for (auto kv : d) {
      pack_into(p, b, kv.first, pickler, depth + 1);
      pack_into(p, b, kv.second, pickler, depth + 1);
    }
    return;
  }
  if (pack_fabric_buffer(b, obj)) return;
  if (pack_sender(p, obj)) return;
  if (pack_ndarray(b, obj)) return;  // before __index__, which ndarray has
  if (PyIndex_Check(o)) {
    // An integer of another type (numpy.int64, ...): as the int it stands
    // for, so that a C++ callee reads it as one.
    py::object as_int = py::reinterpret_steal<py::object>(PyNumber_Index(o));
    if (as_int) return pack_into(p, b, as_int, pickler, depth + 1);
    // A type with the slot that is not an integer after all (a small
    // numpy array: "only integer scalar arrays ..."): pickled, as other
    // values msgpack cannot hold.
    if (!PyErr_ExceptionMatches(PyExc_TypeError)) throw py::error_already_set();
    PyErr_Clear();
  }
  if (PyObject_CheckBuffer(o) && pack_large_buffer(p, b, obj)) return;
  pack_pickled(p, b, obj, pickler);
}

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
py::object unpack_pickled_out_of_band(const Payload& src, const msgpack::object_ext& ext, py::handle unpickler) {
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

py::object unpack_object(const Payload& src, const msgpack::object& o, py::handle unpickler, int depth);

// Unpacks exactly one msgpack value that fills `bytes` (inside `src`), by
// reference: bin, str and ext point into `src`.
py::object unpack_in(const Payload& src, std::span<const std::uint8_t> bytes, py::handle unpickler, int depth) {
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
py::object unpack_padded(const Payload& src, const msgpack::object_ext& ext, py::handle unpickler, int depth) {
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
  return py::module_::import("spindle._messages")
      .attr("_sender")(o.via.array.ptr[0].via.u64, o.via.array.ptr[1].via.u64);
}

py::object unpack_object(const Payload& src, const msgpack::object& o, py::handle unpickler, int depth) {
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
        py::object k = unpack_object(src, o.via.map.ptr[i].key, unpickler, depth + 1);
        if (PyList_Check(k.ptr())) k = py::tuple(k);  // msgpack arrays as keys: hashable
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

}  // namespace

std::string ndarray_prefix(const std::string& dtype, py::handle shape, std::size_t nbytes) {
  msgpack::sbuffer header;
  Packer hp(header);
  hp.pack_array(2);
  hp.pack(dtype);
  py::tuple dims = py::reinterpret_borrow<py::tuple>(shape);
  hp.pack_array(static_cast<std::uint32_t>(dims.size()));
  for (py::handle d : dims) hp.pack_uint64(d.cast<std::uint64_t>());
  if (header.size() > 0xffff) throw py::value_error("spindle: an array with too many dimensions to send");
  if (nbytes + 2 + header.size() > UINT32_MAX)
    throw py::value_error("spindle: an array above 4 GiB cannot travel as one msgpack ext");
  msgpack::sbuffer out;
  Packer(out).pack_ext(nbytes + 2 + header.size(), kNdarrayExtType);
  const char len[2] = {static_cast<char>(header.size() >> 8), static_cast<char>(header.size() & 0xff)};
  out.write(len, 2);
  out.write(header.data(), header.size());
  return std::string(out.data(), out.size());
}

Payload pack(py::handle obj, py::handle pickler) {
  // A spindle.Buffer on its own is the whole message: its sealed memfd.
  if (py::isinstance<FabricBuffer>(obj)) return obj.cast<FabricBuffer&>().payload();
  PayloadBuilder b;
  Packer p(b.buffer());
  pack_into(p, b, obj, pickler, 0);
  return b.finish();
}

py::object unpack(const Payload& bytes, py::handle unpickler) {
  // Unpacked by reference: bin, str and ext point into `src`, so a large bin
  // becomes a view of the received bytes. They must be one range for that;
  // a message in several slices is joined once (a memfd body never is).
  Payload src = bytes.contiguous().size() == bytes.size() ? bytes : bytes.owned_copy();
  return unpack_in(src, src.contiguous(), unpickler, 0);
}

py::bytes to_bytes(const Payload& p) {
  auto c = p.contiguous();
  if (c.size() == p.size()) return py::bytes(reinterpret_cast<const char*>(c.data()), c.size());
  std::string s = p.to_string();
  return py::bytes(s);
}

Payload from_bytes(py::handle b) {
  if (py::isinstance<PyPayload>(b)) return b.cast<const PyPayload&>().payload;
  py::buffer_info info = py::reinterpret_borrow<py::buffer>(b).request();
  return Payload::copy_of(std::span<const std::uint8_t>(
      static_cast<const std::uint8_t*>(info.ptr), static_cast<std::size_t>(info.size * info.itemsize)));
}

}  // namespace spindle::python
