// Large buffers without copies: a packed value as a Payload of slices, and a
// received bin as a read-only memoryview of the message's own bytes.
//
// Why: a 256 MiB numpy array copied into a msgpack stream, then into bytes,
// then into a Payload costs three copies and three times the memory. Here
// the sender's buffer becomes one slice of the call's Payload (the library
// copies it once, into the sealed memfd it sends, PROTOCOL 13.7), and the
// receiver's memoryview points into the memfd mapping the library made
// (MAP_SHARED, read-only), which stays mapped while the view lives.
// spindle.Buffer goes one step further for a producer: it fills a memfd in
// place, and that memfd is the message (FabricBuffer, binding.h).
// Thread: the caller holds the GIL, except where a slice owner is dropped
// (any thread: see ExportedBuffer).
#include "binding.h"

#include <unistd.h>

#include <cstring>
#include <utility>

namespace spindle::python {
namespace {

// Keeps a Python buffer exporter alive for as long as the library holds its
// bytes: the owner of a Slice, dropped on any thread (the broker's after a
// send), so the reference goes through PyRef, which never waits for the GIL.
struct ExportedBuffer {
  PyRef ref;  // bytes (immutable) or a memoryview holding the export
};

// The exporter behind a received large bin: a Payload (so the mapping or
// chunk it points into) and the range of the bin's bytes in it.
struct PayloadView {
  Payload keep;
  const std::uint8_t* data;
  std::size_t size;
};

// The received message behind a buffer exporter: a _PayloadView, or a
// memoryview or numpy array (through .base) over one; null if none.
const PayloadView* received_behind(py::handle obj) {
  for (int depth = 0; depth < 8 && obj && !obj.is_none(); ++depth) {
    if (py::isinstance<PayloadView>(obj)) return &obj.cast<const PayloadView&>();
    if (PyMemoryView_Check(obj.ptr())) {
      obj = PyMemoryView_GET_BUFFER(obj.ptr())->obj;
    } else {
      PyObject* base = PyObject_GetAttrString(obj.ptr(), "base");  // numpy's
      if (!base) {
        PyErr_Clear();
        return nullptr;
      }
      Py_DECREF(base);  // still referenced by obj, which we hold
      obj = base;
    }
  }
  return nullptr;
}

}  // namespace

void PayloadBuilder::cut() {
  if (buf_.size() == 0) return;
  auto owner = std::make_shared<msgpack::sbuffer>(std::move(buf_));
  out_.append(Slice{owner, reinterpret_cast<const std::uint8_t*>(owner->data()), owner->size()});
  buf_ = msgpack::sbuffer();  // moved-from: make it a fresh, empty one explicitly
}

void PayloadBuilder::attach(py::handle keep, const void* data, std::size_t size) {
  cut();
  // A received view sent on (a function returning its argument) is held by
  // the message's own Payload, not by a Python reference: that reference
  // would be dropped on the broker thread through Py_AddPendingCall, which
  // runs only when this process's main thread next runs Python; meanwhile the
  // received body stays charged to the link it came on, which stops reading
  // that link, which the next call needs: a deadlock above 64 MiB.
  const auto* bytes = static_cast<const std::uint8_t*>(data);
  if (const PayloadView* v = received_behind(keep); v && bytes >= v->data && bytes + size <= v->data + v->size) {
    out_.append(Slice{std::make_shared<Payload>(v->keep), bytes, size});
    return;
  }
  auto owner = std::shared_ptr<ExportedBuffer>(new ExportedBuffer{PyRef(keep)});
  out_.append(Slice{owner, static_cast<const std::uint8_t*>(data), size});
}

Payload PayloadBuilder::finish() {
  cut();
  return std::move(out_);
}

namespace {

std::size_t page_size() {
  static const std::size_t size = [] {
    long n = ::sysconf(_SC_PAGESIZE);
    return n > 0 ? static_cast<std::size_t>(n) : std::size_t{4096};
  }();
  return size;
}

void put_be(std::uint8_t* at, std::uint64_t v, int bytes) {
  for (int i = bytes - 1; i >= 0; --i, v >>= 8) at[i] = static_cast<std::uint8_t>(v);
}

// The header ext 83 needs: its own (always ext 32: 6 bytes, so its length
// does not depend on the body's), pad_len, the pad and the inner header.
constexpr std::size_t kExt32Header = 6, kPadLength = 2;

std::size_t head_for(std::size_t inner) {
  const std::size_t page = page_size();
  return (kExt32Header + kPadLength + inner + page - 1) / page * page;
}

// The whole mapping's size, checked before anything is mapped: an 8 GiB
// request used to create (and fault in) its memfd first, taking 30 s to fail.
std::size_t checked_total(std::size_t head, std::size_t n) {
  if (n > UINT32_MAX || head + n - kExt32Header > UINT32_MAX)
    throw py::value_error("spindle.Buffer: at most 4 GiB less a page travels as one msgpack value");
  return head + n;
}

}  // namespace

FabricBuffer::FabricBuffer(std::size_t n, std::string inner)
    : head_(head_for(inner.size())), n_(n), inner_(std::move(inner)), buf_(checked_total(head_, n_)) {
  std::uint8_t* h = buf_.bytes().data();
  const std::size_t pad = head_ - kExt32Header - kPadLength - inner_.size();
  h[0] = 0xc9;  // ext 32
  put_be(h + 1, head_ + n_ - kExt32Header, 4);
  h[5] = static_cast<std::uint8_t>(kPaddedExtType);
  put_be(h + 6, pad, 2);
  // The pad is already zero: a fresh memfd reads as zeros.
  std::memcpy(h + head_ - inner_.size(), inner_.data(), inner_.size());
}

const Payload& FabricBuffer::payload() {
  if (!sealed_) sealed_ = std::move(buf_).seal(PayloadBuffer::View::kKeepPrivate);
  return *sealed_;
}

py::memoryview view_of(const Payload& p, const std::uint8_t* data, std::size_t size) {
  py::object exporter = py::cast(PayloadView{p, data, size});
  return py::memoryview(exporter);
}

py::object payload_object(Payload p) { return py::cast(PyPayload{std::move(p)}); }

void bind_buffers(py::module_& m) {
  py::class_<PayloadView>(m, "_PayloadView", py::buffer_protocol())
      .def_buffer([](PayloadView& v) {
        return py::buffer_info(const_cast<std::uint8_t*>(v.data), 1, "B", 1,
                               {static_cast<py::ssize_t>(v.size)}, {1}, /*readonly=*/true);
      });
  py::class_<FabricBuffer>(m, "Buffer", py::buffer_protocol(), R"doc(
A writable buffer over a fresh memfd, filled in place and sent without a copy.

    buf = spindle.Buffer(1 << 20)             # arrives as a read-only memoryview
    buf = spindle.Buffer(shape=(64, 3, 224, 224), dtype="float32")
    buf.array[:] = ...                        # arrives as a read-only ndarray

Sent as the whole message (ctx.send(handle, buf), or returned by a function
a parent calls), the memfd itself is the message: no copy on either side.
Inside a larger value (a call's arguments) it is copied once, like any large
buffer. The first send seals it: later writes stay in this process, and
every send carries what it held then. A Buffer that a process forked since
still maps cannot be sealed as it is: it is sent as a sealed copy.)doc")
      .def(py::init([](py::object size, py::object shape, py::object dtype) {
             if (size.is_none() == shape.is_none())
               throw py::type_error("spindle.Buffer: give either size or shape (with dtype)");
             if (!size.is_none()) {
               if (!dtype.is_none()) throw py::type_error("spindle.Buffer: dtype goes with shape, not size");
               const auto n = size.cast<py::ssize_t>();
               if (n < 0) throw py::value_error("spindle.Buffer: size must not be negative");
               msgpack::sbuffer inner;
               Packer(inner).pack_bin(static_cast<std::uint32_t>(std::min<py::ssize_t>(n, UINT32_MAX)));
               return std::make_unique<FabricBuffer>(static_cast<std::size_t>(n), std::string(inner.data(), inner.size()));
             }
             py::module_ np = py::module_::import("numpy");
             py::object dt = np.attr("dtype")(dtype.is_none() ? py::object(py::str("float64")) : dtype);
             if (dt.attr("hasobject").cast<bool>())
               throw py::type_error("spindle.Buffer: a dtype holding Python objects cannot be sent");
             py::tuple dims = py::isinstance<py::int_>(shape) ? py::make_tuple(shape) : py::tuple(shape);
             std::size_t n = dt.attr("itemsize").cast<std::size_t>();
             for (py::handle d : dims) {
               const auto v = d.cast<py::ssize_t>();
               if (v < 0) throw py::value_error("spindle.Buffer: a dimension must not be negative");
               if (v != 0 && n > UINT32_MAX / static_cast<std::size_t>(v))
                 throw py::value_error("spindle.Buffer: at most 4 GiB less a page travels as one msgpack value");
               n *= static_cast<std::size_t>(v);
             }
             auto buf = std::make_unique<FabricBuffer>(n, ndarray_prefix(py::str(dt.attr("str")), dims, n));
             buf->dtype = dt;
             buf->shape = dims;
             return buf;
           }),
           py::arg("size") = py::none(), py::kw_only(), py::arg("shape") = py::none(),
           py::arg("dtype") = py::none())
      .def_buffer([](FabricBuffer& b) {
        return py::buffer_info(b.data(), 1, "B", 1, {static_cast<py::ssize_t>(b.size())}, {1},
                               /*readonly=*/false);
      })
      .def("__len__", &FabricBuffer::size)
      .def_property_readonly("sealed", &FabricBuffer::sealed, "whether it was sent (later writes are not)")
      .def_property_readonly(
          "array",
          [](py::object self) {
            auto& b = self.cast<FabricBuffer&>();
            py::module_ np = py::module_::import("numpy");
            if (b.dtype.is_none()) return np.attr("frombuffer")(self, np.attr("uint8"));
            return np.attr("frombuffer")(self, b.dtype).attr("reshape")(b.shape);
          },
          "a writable numpy array over the buffer (uint8 unless made with shape and dtype)");
  // A packed value or a received message, passed between the package and
  // the C++ side as it is: turning it into bytes would copy it.
  py::class_<PyPayload>(m, "Payload")
      .def("__len__", [](const PyPayload& p) { return p.payload.size(); })
      .def("__bytes__", [](const PyPayload& p) { return to_bytes(p.payload); })
      .def_property_readonly("slices", [](const PyPayload& p) { return p.payload.slices().size(); },
                             "how many separate byte ranges it is made of (1 when contiguous)")
      .def_property_readonly("is_memfd", [](const PyPayload& p) { return p.payload.memfd() != nullptr; },
                             "whether its bytes are a mapping of a received (or sealed) memfd");
}

}  // namespace spindle::python
