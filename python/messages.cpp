// Messages for Python: ctx.send(), receivers and Select, over the library's
// own Select (services/select.h), with file descriptors.
//
// Design: one mechanism. Every Python receiver is a services::Receiver in
// some services::Select (a SelectCore here): a Receiver alone has a Select
// of its own (a Select of one), and spindle.Select([rx, ...]) moves each
// receiver into its Select's core. The move runs on the broker thread, the
// only thread that runs a receiver's handler (services::Receiver registers
// it without any_thread), so no message can arrive in between: what was
// queued in the old Select is taken out and kept, in order, in the new
// core's `pending` queue for that receiver, the old receiver is removed and
// a new one registered on the same handle. Fairness between receivers is
// the library's (lanes.h); while moved messages are pending, their
// receivers take turns with the Select, and a receiver's newer messages
// wait behind its pending ones.
//
// A Port is what sends and makes receivers for one router (a Runtime's, a
// Connection's or a ChildEnv's): it holds a Context on the router's own id,
// whose link the router clears when it goes, so a Port or receiver that
// outlives its router throws ShutdownError instead of touching freed memory.
//
// Fds: send() duplicates the caller's fds (FdSet::dup_of, CLOEXEC); the
// caller keeps its own. A received message's fds are handed to Python as
// owned ints (FdSet::take_all: the message's own, not duplicates, so a
// receiver near RLIMIT_NOFILE needs no new fd), which the package wraps in
// spindle.Fd objects that close them exactly once.
//
// Thread: entered with the GIL; every wait (the broker round trip of a
// move or close, Select::get) releases it.
#include "binding.h"

#include <Python.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <deque>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <system_error>
#include <utility>
#include <vector>

#include "router/router.h"
#include "services/select.h"
#include "spindle/send_batch.h"

namespace spindle::python {

namespace {

// An OSError with errno, for a failed dup of an fd being sent: the package
// turns EMFILE into FdError and EBADF into ValueError.
[[noreturn]] void raise_os_error(const std::system_error& e) {
  errno = e.code().value();
  PyErr_SetFromErrno(PyExc_OSError);
  throw py::error_already_set();
}

struct SelectCore {
  services::Select select;
  std::mutex mu;
  // Moved from receivers' old Selects, per receiver serial: served before
  // anything newer of that receiver, in turns with the other receivers.
  std::map<std::uint64_t, std::deque<Message>> pending;
  std::uint64_t last_turn = 0;  // the serial served last from `pending`
  // Which receiver a message came through: its serial.
  std::map<const services::Receiver*, std::uint64_t> serials;
  bool closed = false;

  using Got = std::optional<std::pair<std::uint64_t, Message>>;

  // Locked: a message from the Select, kept back (queued behind its
  // receiver's pending ones) if that receiver still has some.
  bool keep_order(Got& got) {
    auto it = pending.find(got->first);
    if (it == pending.end()) return false;
    it->second.push_back(std::move(got->second));
    got.reset();
    return true;
  }
  Got from_select(std::chrono::nanoseconds wait) {
    auto ev = select.get(wait);
    if (!ev) return std::nullopt;
    auto it = serials.find(ev->from);
    return Got(std::in_place, it == serials.end() ? 0 : it->second, std::move(ev->msg));
  }
  // Locked: the next message while some are pending. Receivers with pending
  // messages take turns in serial order, and the Select (the receivers
  // without any) gets a turn after each round.
  Got next_pending() {
    auto it = pending.upper_bound(last_turn);
    if (it == pending.end()) {
      // The Select's turn: one message. One of a receiver that still has
      // some pending joins them (its order), and they are served instead:
      // so what is pending grows by at most one for each message served,
      // never past what the move brought, and the rest waits in the
      // Select's bounded lanes. (Taking every such message at once moved a
      // whole lane here on each turn, without bound.)
      Got got = from_select(std::chrono::nanoseconds(0));
      if (got && !keep_order(got)) {
        last_turn = 0;
        return got;
      }
      it = pending.begin();
    }
    Got got(std::in_place, it->first, std::move(it->second.front()));
    it->second.pop_front();
    last_turn = it->first;
    if (it->second.empty()) pending.erase(it);
    return got;
  }
};

// A message as the package's tuple: (serial, handle, src_id, reply_to,
// dead reason or None, data Payload, [owned fd ints]).
py::tuple message_tuple(std::uint64_t serial, Message& m) {
  // Whatever can throw comes before the fds leave their owners: a peer's
  // dead reply whose text is not UTF-8 must not leak the fds it carried.
  auto text = [](const std::string& s) {
    PyObject* o = PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "replace");
    if (!o) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(o);
  };
  py::object dead = py::none();
  if (m.is_dead()) dead = text(m.text());
  else if (m.is_call_error()) {
    CallErrorText t = parse_call_error(m);
    dead = text(t.type + ": " + t.what);
  }
  py::object data = payload_object(std::move(m.data));
  std::vector<UniqueFd> owned;
  if (!m.fds.empty()) {
    try {
      owned = m.fds.take_all();  // the message's own fds: no dup near RLIMIT_NOFILE
    } catch (const std::system_error& e) {
      raise_os_error(e);
    }
  }
  py::list fds;
  for (const UniqueFd& f : owned) fds.append(f.get());
  py::tuple out = py::make_tuple(serial, m.header.handle, m.header.src_id, m.header.reply_to, dead, data, fds);
  for (UniqueFd& f : owned) (void)f.release();  // the package's Fd objects own them now
  return out;
}

// The next message of `core`, or None on timeout (seconds < 0: none) or
// once the core is closed. Waits in slices so that Ctrl-C is seen.
py::object select_get(const std::shared_ptr<SelectCore>& core, double seconds) {
  using Clock = std::chrono::steady_clock;
  const bool forever = seconds < 0 || seconds >= kMaxWaitSeconds;  // float('inf') too
  const auto deadline = forever ? Clock::time_point::max()
                                : Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                     std::chrono::duration<double>(seconds));
  for (;;) {
    SelectCore::Got got;
    bool closed = false;
    {
      py::gil_scoped_release nogil;
      {
        std::lock_guard lk(core->mu);
        closed = core->closed;
        if (!closed && !core->pending.empty()) got = core->next_pending();
      }
      if (!got && !closed) {
        auto now = Clock::now();
        auto slice = std::chrono::nanoseconds(std::chrono::milliseconds(250));
        if (!forever && deadline - now < slice) slice = std::max(deadline - now, Clock::duration::zero());
        got = core->from_select(slice);
        if (got) {
          std::lock_guard lk(core->mu);
          if (core->keep_order(got)) continue;  // a receiver moved in meanwhile
        }
      }
    }
    if (got) return message_tuple(got->first, got->second);
    if (closed) return py::none();
    if (!forever && Clock::now() >= deadline) return py::none();
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  }
}

void close_core(SelectCore& core) {
  {
    std::lock_guard lk(core.mu);
    core.closed = true;
  }
  core.select.close();
}

// Runs fn on the router's broker thread and waits for it (GIL released).
template <class F>
void on_broker(Router& r, F fn) {
  py::gil_scoped_release nogil;
  if (r.broker().on_broker_thread()) return fn();
  std::promise<void> done;
  auto f = done.get_future();
  if (!r.broker().try_defer([&] {
        try {
          fn();
          done.set_value();
        } catch (...) {
          done.set_exception(std::current_exception());
        }
      }))
    throw ShutdownError("spindle: the router is shutting down");
  f.get();
}

// At interpreter exit the GIL stays held (nothing else may run then).
bool finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

std::uint64_t next_serial() {
  static std::uint64_t n = 0;  // under the GIL
  return ++n;
}

struct PyReceiver {
  Context self;  // the router's own context: ShutdownError once it is gone
  std::shared_ptr<SelectCore> home;
  std::shared_ptr<SelectCore> own;  // its Select of one
  std::unique_ptr<services::Receiver> rx;
  std::uint32_t handle = 0;
  std::uint64_t serial = next_serial();

  PyReceiver(Context s) : self(std::move(s)), home(std::make_shared<SelectCore>()), own(home) {
    Router& r = self.router();
    on_broker(r, [&] { attach(r, 0); });
  }
  ~PyReceiver() {
    if (!rx) return;
    try {
      Router& r = self.router();
      (void)r;
      if (Py_IsInitialized() && !finalizing() && PyGILState_Check()) {
        py::gil_scoped_release nogil;  // removing the handler waits for the broker
        rx.reset();
      } else {
        rx.reset();
      }
    } catch (const ShutdownError&) {
      (void)rx.release();  // the router and its handlers are gone: nothing to remove
    }
  }

  // Broker thread: registers on `handle_` (0: a fresh one) in home's Select.
  void attach(Router& r, std::uint32_t h) {
    rx = std::make_unique<services::Receiver>(r, home->select, h);
    handle = rx->handle();
    std::lock_guard lk(home->mu);
    home->serials[rx.get()] = serial;
  }

  void move_to(const std::shared_ptr<SelectCore>& dest) {
    if (!rx) throw ChannelError("spindle: the receiver is closed");
    if (dest == home) return;
    Router& r = self.router();
    on_broker(r, [&] {
      // Nothing reaches the handler meanwhile: it runs on this thread.
      // A Select of one: everything in it is this receiver's.
      std::deque<Message> moved;
      {
        std::lock_guard lk(home->mu);
        for (auto& [_, q] : home->pending)
          for (Message& m : q) moved.push_back(std::move(m));
        home->pending.clear();
        home->serials.erase(rx.get());
      }
      while (auto ev = home->select.get(std::chrono::nanoseconds(0))) moved.push_back(std::move(ev->msg));
      rx.reset();
      home = dest;
      attach(r, handle);
      if (!moved.empty()) {
        std::lock_guard lk(dest->mu);
        auto& q = dest->pending[serial];
        for (Message& m : moved) q.push_back(std::move(m));
      }
    });
    if (own) {
      close_core(*own);  // wakes a thread still waiting on the receiver alone
      own.reset();
    }
  }

  void close() {
    if (rx) {
      std::unique_ptr<services::Receiver> doomed = std::move(rx);
      {
        std::lock_guard lk(home->mu);
        home->serials.erase(doomed.get());
      }
      try {
        Router& r = self.router();
        (void)r;
        py::gil_scoped_release nogil;
        doomed.reset();  // later messages: "invalid handle"; queued ones: a dead reply
      } catch (const ShutdownError&) {
        (void)doomed.release();
      }
    }
    if (own) close_core(*own);
  }
  // In an os.fork() child: the copies refer to a broker that does not exist.
  void abandon() {
    (void)rx.release();
    new std::shared_ptr<SelectCore>(home);  // leaked: its destructor would send dead replies
    if (own) new std::shared_ptr<SelectCore>(own);
  }
};

struct PyPort {
  Context self;
  pid_t pid = ::getpid();  // the process whose router this is

  // In an os.fork() child, a copy of the parent's port refers to a router
  // whose broker thread is not there: a send would queue where nothing
  // writes it (and block once the queue is full), a receiver or a batch
  // would wait for that thread forever, and whatever did go out would go
  // down the link the parent shares. The after-fork hook closes the
  // package's Routers and Connections, but a Sender holds the port itself,
  // so the port checks. getpid() is a syscall of well under a microsecond,
  // small beside packing the value.
  void check_process() const {
    const pid_t here = ::getpid();
    if (here != pid)
      throw ShutdownError("spindle: this Sender's router belongs to pid " + std::to_string(pid) +
                          ", not to this process (pid " + std::to_string(here) +
                          "): it was inherited through a fork and cannot send or receive here "
                          "(make a new Router or Connection in the child)");
  }

  // Sends msgpack `data` to (dst, handle) with duplicates of `fds`.
  void send(std::uint32_t dst, std::uint32_t handle, py::handle data, const std::vector<int>& fds,
            std::uint32_t reply_to) const {
    check_process();
    if (fds.size() > kMaxFdsPerMessage)
      throw py::value_error("spindle: " + std::to_string(fds.size()) + " fds exceed the limit of " +
                            std::to_string(kMaxFdsPerMessage) + " per message");
    Message m = Message::make(dst, handle, from_bytes(data));
    m.header.reply_to = reply_to;
    if (!fds.empty()) {
      try {
        m.fds = FdSet::dup_of(fds);
      } catch (const std::system_error& e) {
        raise_os_error(e);
      }
    }
    Router& r = self.router();
    GilForSend gil(m.data);  // let go if send() waits for a full queue
    r.send(std::move(m));
  }
};

// `with router.batch():` (spindle::SendBatch). The batch is a mark on the
// thread that entered it; left on another thread (a generator closed by the
// collector), it still ends, and that thread stops gathering.
struct PyBatch {
  explicit PyBatch(Context c) : self(std::move(c)) {}
  Context self;
  std::optional<SendBatch> batch;

  PyBatch& enter() {
    if (batch) throw py::value_error("spindle: this batch is already open (make one per `with`)");
    batch.emplace(self);
    return *this;
  }
  bool exit(const py::args&) {
    batch.reset();  // wakes the broker once: no wait, so the GIL is kept
    return false;
  }
};

}  // namespace

py::object make_port(Router& router) {
  return py::cast(PyPort{Context(router, router.id(), "self")});
}

void bind_messages(py::module_& m) {
  m.attr("MAX_FDS_PER_MESSAGE") = kMaxFdsPerMessage;

  py::class_<PyPort>(m, "Port")
      .def_property_readonly("id", [](const PyPort& p) { return p.self.router().id(); })
      .def("send", &PyPort::send, py::arg("dst"), py::arg("handle"), py::arg("data"), py::arg("fds"),
           py::arg("reply_to"))
      .def("receiver", [](const PyPort& p) {
        p.check_process();
        return std::make_shared<PyReceiver>(p.self);
      })
      .def("batch", [](const PyPort& p) {
        p.check_process();
        return std::make_unique<PyBatch>(p.self);
      });

  py::class_<PyBatch, std::unique_ptr<PyBatch>>(m, "SendBatch")
      .def("__enter__", &PyBatch::enter, py::return_value_policy::reference_internal)
      .def("__exit__", &PyBatch::exit);

  py::class_<SelectCore, std::shared_ptr<SelectCore>>(m, "SelectCore")
      .def(py::init<>())
      .def("get", &select_get, py::arg("timeout"))
      .def("close", [](SelectCore& c) {
        py::gil_scoped_release nogil;
        close_core(c);
      })
      .def("abandon", [](std::shared_ptr<SelectCore>& c) { new std::shared_ptr<SelectCore>(c); })
      .def("_pending", [](SelectCore& c) {  // for the tests: messages kept beside the Select
        std::lock_guard lk(c.mu);
        std::size_t n = 0;
        for (const auto& [_, q] : c.pending) n += q.size();
        return n;
      });

  py::class_<PyReceiver, std::shared_ptr<PyReceiver>>(m, "ReceiverCore")
      .def_readonly("handle", &PyReceiver::handle)
      .def_readonly("serial", &PyReceiver::serial)
      .def_property_readonly("context_id", [](const PyReceiver& r) { return r.self.id(); })
      .def("get", [](PyReceiver& r, double timeout) {
        if (!r.own) throw py::value_error("spindle: this receiver belongs to a Select: get() from the Select");
        // A copy: Select.add() on another thread resets r.own (the last
        // reference) while this thread waits on the core without the GIL.
        std::shared_ptr<SelectCore> core = r.own;
        return select_get(core, timeout);
      })
      .def("move_to", &PyReceiver::move_to)
      .def("close", &PyReceiver::close)
      .def("abandon", &PyReceiver::abandon);
}

}  // namespace spindle::python
