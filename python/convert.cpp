// Python values <-> the msgpack of typed calls (docs/PROTOCOL.md 12.6).
//
// The mapping is msgpack's usual one, so that a C++ peer's codec<T> reads
// what Python sends: None nil, bool, int (64-bit), float (float64), str, bytes
// (bytearray and memoryview too) bin, list and tuple array, dict map. What
// has __index__ (numpy's integers) is an int, a float subclass
// (numpy.float64) a float. What does not fit (a set, an instance, an int
// beyond 64 bits) is pickled into ext type 80 when a pickler is given; a
// receiver decides whether it accepts pickle (see the package). Decoding walks the input once first
// (detail::unpack_checked), so hostile bytes cannot make it allocate much.
// Thread: the caller holds the GIL.
#include "binding.h"

#include <cstring>
#include <span>
#include <string>

#include <spindle/codec.h>

namespace spindle::python {
namespace {

// Deep enough for any sane argument; deeper is a reference cycle or an
// attack, and recursion must stay within the C stack.
constexpr int kMaxDepth = 512;

void pack_into(Packer& p, py::handle obj, py::handle pickler, int depth);

void pack_pickled(Packer& p, py::handle obj, py::handle pickler) {
  if (pickler.is_none())
    throw py::type_error(std::string("spindle: cannot send a value of type ") +
                         std::string(py::str(py::type::handle_of(obj).attr("__qualname__"))) +
                         " as msgpack, and pickle is off for this call");
  py::bytes b = pickler(obj);
  std::string_view s = b;
  p.pack_ext(s.size(), kPickleExtType);
  p.pack_ext_body(s.data(), s.size());
}

void pack_into(Packer& p, py::handle obj, py::handle pickler, int depth) {
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
    return pack_pickled(p, obj, pickler);  // beyond 64 bits
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
    {
      p.pack_bin_body(PyBytes_AS_STRING(o), static_cast<std::uint32_t>(PyBytes_GET_SIZE(o)));
      return;
    }
  }
  if (PyByteArray_Check(o) || PyMemoryView_Check(o)) {
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
    {
      p.pack_bin_body(static_cast<const char*>(view.buf), n);
      return;
    }
  }
  if (PyList_Check(o) || PyTuple_Check(o)) {
    py::sequence seq = py::reinterpret_borrow<py::sequence>(obj);
    p.pack_array(static_cast<std::uint32_t>(seq.size()));
    for (py::handle item : seq) pack_into(p, item, pickler, depth + 1);
    return;
  }
  if (PyDict_Check(o)) {
    py::dict d = py::reinterpret_borrow<py::dict>(obj);
    p.pack_map(static_cast<std::uint32_t>(d.size()));
    for (auto kv : d) {
      pack_into(p, kv.first, pickler, depth + 1);
      pack_into(p, kv.second, pickler, depth + 1);
    }
    return;
  }
  if (PyIndex_Check(o)) {
    // An integer of another type (numpy.int64, ...): as the int it stands
    // for, so that a C++ callee reads it as one.
    py::object as_int = py::reinterpret_steal<py::object>(PyNumber_Index(o));
    if (!as_int) throw py::error_already_set();
    return pack_into(p, as_int, pickler, depth + 1);
  }
  pack_pickled(p, obj, pickler);
}

py::object unpack_object(const msgpack::object& o, py::handle unpickler, int depth) {
  if (depth > kMaxDepth) throw py::value_error("spindle: received value nested too deeply");
  switch (o.type) {
    case msgpack::type::NIL: return py::none();
    case msgpack::type::BOOLEAN: return py::bool_(o.via.boolean);
    case msgpack::type::POSITIVE_INTEGER: return py::reinterpret_steal<py::object>(PyLong_FromUnsignedLongLong(o.via.u64));
    case msgpack::type::NEGATIVE_INTEGER: return py::reinterpret_steal<py::object>(PyLong_FromLongLong(o.via.i64));
    case msgpack::type::FLOAT32:
    case msgpack::type::FLOAT64: return py::float_(o.via.f64);
    case msgpack::type::STR: return py::str(o.via.str.ptr, o.via.str.size);
    case msgpack::type::BIN: return py::bytes(o.via.bin.ptr, o.via.bin.size);
    case msgpack::type::ARRAY: {
      py::list l(o.via.array.size);
      for (std::uint32_t i = 0; i < o.via.array.size; ++i)
        l[i] = unpack_object(o.via.array.ptr[i], unpickler, depth + 1);
      return l;
    }
    case msgpack::type::MAP: {
      py::dict d;
      for (std::uint32_t i = 0; i < o.via.map.size; ++i) {
        py::object k = unpack_object(o.via.map.ptr[i].key, unpickler, depth + 1);
        if (PyList_Check(k.ptr())) k = py::tuple(k);  // msgpack arrays as keys: hashable
        d[k] = unpack_object(o.via.map.ptr[i].val, unpickler, depth + 1);
      }
      return d;
    }
    case msgpack::type::EXT:
      if (o.via.ext.type() == kPickleExtType)
        return unpickler(py::bytes(o.via.ext.data(), o.via.ext.size));
      throw py::value_error("spindle: received msgpack ext type " +
                            std::to_string(static_cast<int>(o.via.ext.type())) +
                            ", which Python does not take (fds arrive in part 2)");
  }
  throw py::value_error("spindle: received a msgpack value of unknown type");
}

}  // namespace

Payload pack(py::handle obj, py::handle pickler) {
  msgpack::sbuffer buf;
  Packer p(buf);
  pack_into(p, obj, pickler, 0);
  return detail::payload_of(std::move(buf));
}

py::object unpack(const Payload& bytes, py::handle unpickler) {
  msgpack::object_handle h;
  try {
    h = detail::unpack_checked(bytes, "value");
  } catch (const std::exception& e) {
    throw py::value_error(std::string("spindle: received bytes that are not msgpack: ") + e.what());
  }
  return unpack_object(h.get(), unpickler, 0);
}

py::bytes to_bytes(const Payload& p) {
  auto c = p.contiguous();
  if (c.size() == p.size()) return py::bytes(reinterpret_cast<const char*>(c.data()), c.size());
  std::string s = p.to_string();
  return py::bytes(s);
}

Payload from_bytes(py::handle b) {
  py::buffer_info info = py::reinterpret_borrow<py::buffer>(b).request();
  return Payload::copy_of(std::span<const std::uint8_t>(
      static_cast<const std::uint8_t*>(info.ptr), static_cast<std::size_t>(info.size * info.itemsize)));
}

}  // namespace spindle::python
