// Python values -> the msgpack of typed calls (docs/PROTOCOL.md 12.6); the
// way back is unpack.cpp.
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
// receipt they are read-only views of the message.
// Thread: the caller holds the GIL.
#include "binding.h"

#include <cstring>
#include <span>
#include <string>
#include <vector>

#include <spindle/codec.h>

namespace spindle::python {
namespace {

void pack_into(Packer& p, PayloadBuilder& b, py::handle obj, py::handle pickler, int depth);

// The keys a receiver accepts in a map: those whose hash a peer cannot make
// collide at will (see unpack.cpp). An int beyond 64 bits would be pickled.
bool is_scalar_key(py::handle k) {
  PyObject* o = k.ptr();
  return o == Py_None || PyBool_Check(o) || PyFloat_Check(o) || PyUnicode_Check(o) || PyBytes_Check(o) ||
         (PyLong_Check(o) && _PyLong_NumBits(o) <= 63);
}

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

// A module if something imported it already, else a null object: a value
// of a class it defines cannot exist before, and packing never imports.
py::object imported(const char* name) {
  PyObject* mod = PyImport_GetModule(py::str(name).ptr());
  if (!mod && PyErr_Occurred()) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(mod);
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
  py::object messages = imported("spindle._messages");
  if (!messages || !py::isinstance(obj, messages.attr("Sender"))) return false;
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
  py::object np = imported("numpy");
  if (!np || !py::isinstance(obj, np.attr("ndarray"))) return false;
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
  if (PyLong_Check(o)) {  // bool was taken above
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow == 0) {
      if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
      p.pack_int64(v);
      return;
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
    p.pack_str_body(s, static_cast<std::uint32_t>(n));
    return;
  }
  if (PyBytes_Check(o)) {
    if (static_cast<std::size_t>(PyBytes_GET_SIZE(o)) > UINT32_MAX)
      throw py::value_error("spindle: bytes above 4 GiB cannot travel as msgpack bin");
    p.pack_bin(static_cast<std::uint32_t>(PyBytes_GET_SIZE(o)));
    if (static_cast<std::size_t>(PyBytes_GET_SIZE(o)) >= kOutOfBandMin) {
      b.attach(obj, PyBytes_AS_STRING(o), static_cast<std::size_t>(PyBytes_GET_SIZE(o)));
      return;
    }
    p.pack_bin_body(PyBytes_AS_STRING(o), static_cast<std::uint32_t>(PyBytes_GET_SIZE(o)));
    return;
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
    // A receiver takes only scalar keys (unpack.cpp): a dict keyed by
    // tuples or other objects goes pickled, to the family only.
    for (auto kv : d) {
      if (is_scalar_key(kv.first)) continue;
      if (pickler.is_none())
        throw py::type_error("spindle: a dict with a key of type " +
                             std::string(py::str(py::type::handle_of(kv.first).attr("__qualname__"))) +
                             " cannot travel as msgpack (a map's keys are None, bool, int, float, str or "
                             "bytes), and pickle is off for this call");
      return pack_pickled(p, b, obj, pickler);
    }
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
