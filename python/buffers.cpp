// Large buffers without copies: a packed value as a Payload of slices, and a
// received bin as a read-only memoryview of the message's own bytes.
//
// Why: a 256 MiB numpy array copied into a msgpack stream, then into bytes,
// then into a Payload costs three copies and three times the memory. Here
// the sender's buffer becomes one slice of the call's Payload (the library
// copies it once, into the sealed memfd it sends, PROTOCOL 13.7), and the
// receiver's memoryview points into the memfd mapping the library made
// (MAP_SHARED, read-only), which stays mapped while the view lives.
// Thread: the caller holds the GIL, except where a slice owner is dropped
// (any thread: see ExportedBuffer).
#include "binding.h"

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

}  // namespace

void PayloadBuilder::cut() {
  if (buf_.size() == 0) return;
  auto owner = std::make_shared<msgpack::sbuffer>(std::move(buf_));
  out_.append(Slice{owner, reinterpret_cast<const std::uint8_t*>(owner->data()), owner->size()});
  buf_ = msgpack::sbuffer();  // moved-from: make it a fresh, empty one explicitly
}

void PayloadBuilder::attach(py::handle keep, const void* data, std::size_t size) {
  cut();
  auto owner = std::shared_ptr<ExportedBuffer>(new ExportedBuffer{PyRef(keep)});
  out_.append(Slice{owner, static_cast<const std::uint8_t*>(data), size});
}

Payload PayloadBuilder::finish() {
  cut();
  return std::move(out_);
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
