// spindle._spindle: the pybind11 module under the Python package spindle.
//
// Role: the module's definition. The package (python/spindle/__init__.py)
// is the API users see; this module gives it the C++ pieces: msgpack
// conversion (pack/unpack, convert.cpp) and the wrappers of the runtime
// objects (runtime_objects.cpp). See binding.h for the GIL rules.
#include "binding.h"

namespace spindle::python {

PYBIND11_MODULE(_spindle, m) {
  m.doc() = "Spindle's C++ core for the spindle package (use the package, not this module)";
  m.attr("PICKLE_EXT_TYPE") = static_cast<int>(kPickleExtType);
  m.attr("OK") = static_cast<int>(kOk);
  m.attr("CALL_ERROR") = static_cast<int>(kCallError);
  m.attr("CHANNEL_ERROR") = static_cast<int>(kChannel);
  m.attr("TIMEOUT") = static_cast<int>(kTimeout);
  m.attr("SHUTDOWN") = static_cast<int>(kShutdown);
  m.attr("OTHER_ERROR") = static_cast<int>(kOtherError);
  // The SE type of an exposed Python function's exception (runtime_objects.cpp).

  m.def("pack", [](py::handle obj, py::handle pickler) { return payload_object(pack(obj, pickler)); },
        py::arg("obj"), py::arg("pickler") = py::none(),
        "obj as msgpack (a _spindle.Payload; bytes(p) copies it out); large buffers are referenced, not copied; what msgpack cannot hold is pickled with pickler (ext type 80)");
  m.def("unpack", [](py::handle data, py::handle unpickler) { return unpack(from_bytes(data), unpickler); },
        py::arg("data"), py::arg("unpickler"),
        "msgpack (a _spindle.Payload or bytes) as a Python value; ext type 80 goes to unpickler(bytes); a large bin is a read-only memoryview of it");
  m.def("decode", [](py::handle data, py::handle trust, py::handle sender, py::handle port) {
          return decode(from_bytes(data), trust, sender, port);
        },
        py::arg("data"), py::arg("trust"), py::arg("sender"), py::arg("port"),
        "unpack() of what `sender` sent: pickles go to trust.unpickler(sender), asked only if one comes; a Sender in the value sends through port");
  m.def("_decoding_port", &decoding_port, "The port of the decode() running on this thread, else None");

  // The package's exception classes, for C++ exceptions thrown at once
  // (not through a call's outcome): ShutdownError, ChannelError,
  // TimeoutError, and spindle.Error for every other spindle::Error.
  m.def("_set_error_classes", [](py::object base, py::object channel, py::object timeout,
                                 py::object shutdown) {
    // Leaked on purpose: translators may run until the interpreter ends.
    static PyObject* classes[4] = {};
    classes[0] = base.release().ptr();
    classes[1] = channel.release().ptr();
    classes[2] = timeout.release().ptr();
    classes[3] = shutdown.release().ptr();
    py::register_exception_translator([](std::exception_ptr p) {
      try {
        if (p) std::rethrow_exception(p);
      } catch (const ShutdownError& e) {
        PyErr_SetString(classes[3], e.what());
      } catch (const TimeoutError& e) {
        PyErr_SetString(classes[2], e.what());
      } catch (const ChannelError& e) {
        PyErr_SetString(classes[1], e.what());
      } catch (const Error& e) {
        PyErr_SetString(classes[0], e.what());
      }
    });
  });

  bind_buffers(m);
  bind_runtime_objects(m);
  bind_messages(m);
}

}  // namespace spindle::python
