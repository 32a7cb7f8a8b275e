// The pybind11 extension spindle._spindle: declarations shared by its files.
//
// Role: the thin C++ layer under the Python package python/spindle/. It
//  - converts Python values to the msgpack of typed calls and back
//    (convert.cpp), with pickle as an ext type for what msgpack cannot hold;
//  - wraps Runtime, Connection, Context, Child and ChildEnv
//    (runtime_objects.cpp), releasing the GIL wherever C++ may wait;
//  - hands completions from the broker thread to Python through a queue
//    (Completions): no Python code, and no Python reference count, is ever
//    touched on the broker thread.
// Thread: every function here is entered from Python with the GIL held.
// Ownership: the wrappers own their C++ objects; abandon() leaks them on
// purpose in a forked child, whose copies refer to threads that do not
// exist there.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include <spindle/codec.h>
#include <spindle/spindle.h>

#include "broker/wait_hook.h"
#include "stream/memfd.h"

namespace spindle::python {

namespace py = pybind11;

// msgpack ext type of a pickled Python object (pickle protocol 5 bytes).
inline constexpr std::int8_t kPickleExtType = 80;

// msgpack ext type of pickle protocol 5 with out-of-band buffers: the
// body is the msgpack array [pickle bytes, buffer...] of bins.
inline constexpr std::int8_t kPickleOutOfBandExtType = 82;
// msgpack ext type of a numpy array sent out of band (PROTOCOL 12.7): the
// body is a 2-byte big-endian header length, the header (msgpack
// [dtype.str, [shape...]]) and then the array's bytes, C order.
inline constexpr std::int8_t kNdarrayExtType = 81;
// A buffer at least this large (RouterOptions::memfd_threshold's default)
// is not copied into the msgpack stream: it is a slice of its own in the
// Payload, and a received bin this large is a memoryview of the message.
inline constexpr std::size_t kOutOfBandMin = std::size_t{1} << 20;

// msgpack ext type of a padded value (api/codec.h): a spindle.Buffer's form.
using spindle::kPaddedExtType;
// A spindle.Sender: ext 84 around [context id, handle] (api/codec.h).
using spindle::kSenderExtType;

// The bytes of a numpy array's ext 81 form that come before its data: the
// ext header, the header length and the header ([dtype, [shape...]]).
std::string ndarray_prefix(const std::string& dtype, py::handle shape, std::size_t nbytes);

// spindle.Buffer: a writable buffer over a fresh memfd, filled in place and
// sent without a copy. The memfd holds one msgpack value, ext 83 around
// `inner` (a bin, or an ndarray's ext 81), whose data start at a page
// boundary after the header: sent as a whole message (send(), or a
// function's result), the sealed memfd is the message body itself. Sealed
// on first send; the writable view stays valid afterwards as the process's
// private copy (PayloadBuffer::View::kKeepPrivate).
class FabricBuffer {
 public:
  FabricBuffer(std::size_t n, std::string inner);
  std::uint8_t* data() { return buf_.bytes().data() + head_; }
  std::size_t size() const { return n_; }
  bool sealed() const { return sealed_.has_value(); }
  // The whole message, sealed on the first call.
  const Payload& payload();
  // The inner value's header, and its n data bytes inside payload().
  std::string_view inner_prefix() const { return inner_; }
  const std::uint8_t* sealed_data() { return payload().contiguous().data() + head_; }

  py::object dtype = py::none();  // of .array; None for a plain buffer
  py::object shape = py::none();

 private:
  std::size_t head_;  // the bytes before the data: a multiple of the page size
  std::size_t n_;
  std::string inner_;
  PayloadBuffer buf_;
  std::optional<Payload> sealed_;
};

// How deeply values may nest, packed or unpacked: enough for any sane
// argument; deeper is a reference cycle or an attack, and the recursion
// must stay within the C stack.
inline constexpr int kMaxDepth = 512;
// The longest wait a timeout converts to (ten years): float('inf') and
// anything longer mean "wait", and must not overflow the clocks' arithmetic.
inline constexpr double kMaxWaitSeconds = 10.0 * 365 * 24 * 3600;

// A Payload as a Python object (_spindle.Payload): what pack() returns and
// the calls take and give, so a large value is never turned into bytes.
struct PyPayload {
  Payload payload;
};

// Builds a Payload of msgpack bytes and, between them, slices of Python
// buffers that are referenced, not copied.
class PayloadBuilder {
 public:
  msgpack::sbuffer& buffer() { return buf_; }
  // Ends the current msgpack bytes and appends `size` bytes at `data`,
  // kept alive by a reference to `keep` (bytes, or a memoryview).
  void attach(py::handle keep, const void* data, std::size_t size);
  Payload finish();

 private:
  void cut();
  msgpack::sbuffer buf_;
  Payload out_;
};

// A read-only memoryview of `size` bytes at `data` inside `p`, which it keeps
// alive (with the memfd mapping or chunk the bytes live in).
py::memoryview view_of(const Payload& p, const std::uint8_t* data, std::size_t size);
py::object payload_object(Payload p);
void bind_buffers(py::module_& m);

// Python value -> msgpack. An object msgpack cannot hold is pickled with
// `pickler` (a callable returning bytes, or (bytes, [PickleBuffer...]) for
// out-of-band buffers) into ext type 80 (82); with pickler None it is a
// TypeError.
Payload pack(py::handle obj, py::handle pickler);
// msgpack -> Python value. The bytes of ext type 80 are passed to
// `unpickler` (the package passes pickle.loads, or a function that raises
// spindle.PickleRefusedError where pickle is not accepted).
py::object unpack(const Payload& bytes, py::handle unpickler);
// unpack() as the package decodes what `sender` sent: the unpickler is
// trust.unpickler(sender) (errors._PickleTrust), asked only if a pickle
// comes, and a Sender in the value (or in a pickle in it) sends through
// `port`, which decoding_port() returns while the decode runs (else None).
py::object decode(const Payload& bytes, py::handle trust, py::handle sender, py::handle port);
py::object decoding_port();
py::bytes to_bytes(const Payload& p);
Payload from_bytes(py::handle b);  // a _spindle.Payload (as it is), or bytes-like (copied)

// How a call ended, as a tuple the package turns into a result or an
// exception: (kind, a, b) with kind one of these.
enum Outcome : int {
  kOk = 0,          // a: the result (a _spindle.Payload; from call_value, decoded)
  kCallError = 1,   // a: remote type, b: remote message
  kChannel = 2,     // a: the reason
  kTimeout = 3,     // a: text
  kShutdown = 4,    // a: text
  kOtherError = 5,  // a: text
};
py::tuple outcome_of(std::exception_ptr e);

// Completions of asynchronous calls, from the broker thread to the Python
// thread that waits in get(). push() takes only a C++ lock.
class Completions {
 public:
  struct Item {
    std::uint64_t token;
    std::exception_ptr error;
    Payload result;
  };
  void push(Item item);
  // Waits (GIL released) for completions: a list of every (token, outcome)
  // queued, or None once close() was called and the queue is empty.
  py::object get();
  void close();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> items_;
  bool closed_ = false;
};

// Around a send or a call's start from Python. A small one keeps the GIL:
// it is a few microseconds of work and a non-blocking write, and letting the
// GIL go would hand it to the thread that completes futures and make this
// one wait to get it back (a hand-off per call; see broker/wait_hook.h). If
// the send must wait for queue space, the hook lets the GIL go for the wait.
// A large body, or one in a memfd (to fill or seal, which may take long),
// lets it go for the whole send, as before.
class GilForSend {
 public:
  static constexpr std::size_t kKeepGilMax = 64 * 1024;
  explicit GilForSend(const Payload& body);
  ~GilForSend();
  GilForSend(const GilForSend&) = delete;
  GilForSend& operator=(const GilForSend&) = delete;

 private:
  PyThreadState* released_ = nullptr;  // the whole send runs without the GIL
  PyThreadState* waiting_ = nullptr;   // the hook's: let go for a wait
  WaitHook hook_;
  std::optional<WaitHook::Scope> scope_;
};

// A Python callable kept alive from C++ code that may drop it on a thread
// without the GIL (the broker's): released there, the reference is handed to
// the interpreter (Py_AddPendingCall) instead of waiting for the GIL.
class PyRef {
 public:
  explicit PyRef(py::handle h) : p_(h.ptr()) { Py_XINCREF(p_); }
  ~PyRef();
  PyRef(const PyRef&) = delete;
  PyRef& operator=(const PyRef&) = delete;
  py::handle get() const { return p_; }

 private:
  PyObject* p_;
};

void bind_runtime_objects(py::module_& m);

// Sending and receiving messages for one router (messages.cpp): a
// _spindle.Port, which Runtime, Connection and ChildEnv give as port().
py::object make_port(Router& router);
void bind_messages(py::module_& m);

}  // namespace spindle::python
