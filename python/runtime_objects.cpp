// The extension's wrappers of Runtime, Connection, Context, Child and
// ChildEnv (see binding.h; the completion queue is in completions.cpp).
//
// GIL rules, which keep the broker thread free of Python:
//  - every call that may wait on the broker (a blocking call, spawn, stop,
//    find, close, serve) releases the GIL first;
//  - call_async's start and a send keep it (GilForSend), unless they carry
//    a large or memfd body, and let it go only if they wait for queue space;
//  - a completion on the broker thread only pushes onto Completions (a C++
//    lock); Completions::get() releases the GIL while it waits and takes the
//    GIL back only after dropping its lock, so the broker never waits for a
//    thread that waits for the GIL;
//  - ssh() releases it for the whole start (ssh, the agent's upload, its
//    handshake: up to connect_timeout);
//  - fork() holds the GIL across Runtime::fork_child, as os.fork does
//    (PyOS_BeforeFork / AfterFork_Parent / AfterFork_Child), which is safe
//    because the broker thread, which fork_child parks, never needs it.
#include "binding.h"

#include <Python.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include <spindle/connection.h>

#include "router/router.h"

namespace spindle::python {

namespace {

std::chrono::milliseconds to_ms(double seconds) {
  if (!(seconds > 0)) throw py::value_error("spindle: a timeout must be a positive number of seconds");
  // float('inf'), or any wait longer than ten years, is a wait of ten years:
  // converted as it is, it overflowed (undefined: the call timed out at once).
  seconds = std::min(seconds, kMaxWaitSeconds);
  return std::chrono::milliseconds(static_cast<std::int64_t>(seconds * 1000.0 + 0.5));
}

struct PyContext {
  Context ctx;

  // A blocking call as Context.call makes it: packs `value` (the request),
  // waits with the GIL released, and decodes the result as this context's
  // (see decode()), so that neither becomes a _spindle.Payload object in
  // between. The outcome's a is the result itself.
  py::tuple call_value(const std::string& name, py::handle value, py::handle pickler, double timeout,
                       py::handle trust, py::handle port) const {
    Payload args = pack(value, pickler);
    Context c = ctx.with_timeout(to_ms(timeout));
    std::exception_ptr error;
    Payload result;
    {
      py::gil_scoped_release nogil;
      try {
        result = c.call_named(name, std::move(args));
      } catch (...) {
        error = std::current_exception();
      }
    }
    if (error) return outcome_of(error);
    return py::make_tuple(static_cast<int>(kOk), decode(result, trust, py::int_(ctx.id()), port), py::none());
  }

  void start_call(const std::string& name, py::handle args, double timeout,
                  std::shared_ptr<Completions> queue, std::uint64_t token) const {
    Payload a = from_bytes(args);
    Context c = ctx.with_timeout(to_ms(timeout));
    GilForSend gil(a);
    c.start_call(name, std::move(a), [queue = std::move(queue), token](std::exception_ptr e, Payload r) {
      queue->push({token, std::move(e), std::move(r)});  // broker thread: C++ only
    });
  }
};

// Destroys `owned` without the GIL: its destructor may wait (for a child to
// exit, a broker to stop), and the thread that waits must not hold the
// interpreter. At interpreter exit the GIL stays held (nothing else runs).
bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

template <class T>
void destroy_without_gil(std::unique_ptr<T>& owned) {
  if (!owned) return;
  if (Py_IsInitialized() && !interpreter_finalizing() && PyGILState_Check()) {
    py::gil_scoped_release nogil;
    owned.reset();
  } else {
    owned.reset();
  }
}

struct PyChild {
  std::unique_ptr<Child> child;

  PyChild(std::unique_ptr<Child> c) : child(std::move(c)) {}
  PyChild(PyChild&&) = default;
  ~PyChild() { destroy_without_gil(child); }

  Child& get() {
    if (!child) throw py::value_error("spindle: this child was abandoned after a fork");
    return *child;
  }
  int stop() {
    Child& c = get();
    py::gil_scoped_release nogil;
    return c.stop();
  }
  // In an os.fork() child: the copy refers to the parent's broker, whose
  // thread does not exist here; its destructor would wait for it.
  void abandon() { (void)child.release(); }
};

// The way into a ChildEnv from Python. A Connection's env is freed by
// close(), which another thread may call while one serves (the usual way to
// stop serving) or is about to call ready(): every entry counts itself in,
// and close() shuts the gate, then waits for those inside to leave before it
// frees the env. A child's main env lives as long as main, and its gate is
// never shut.
struct EnvGate {
  std::mutex mu;
  std::condition_variable left;
  ChildEnv* env = nullptr;
  int inside = 0;

  explicit EnvGate(ChildEnv* e) : env(e) {}
  // Called without the GIL: a thread inside may need it to leave.
  void shut_and_wait() {
    std::unique_lock lk(mu);
    env = nullptr;
    left.wait(lk, [&] { return inside == 0; });
  }
};

struct PyChildEnv {
  std::shared_ptr<EnvGate> gate;

  // Holds the env open for one call; throws once the Connection is closed.
  class Entry {
   public:
    explicit Entry(EnvGate& g) : g_(g) {
      std::lock_guard lk(g_.mu);
      if (!g_.env) throw py::value_error("spindle: this connection is closed");
      ++g_.inside;
      env_ = g_.env;
    }
    ~Entry() {
      std::lock_guard lk(g_.mu);
      if (--g_.inside == 0) g_.left.notify_all();
    }
    Entry(const Entry&) = delete;
    Entry& operator=(const Entry&) = delete;
    ChildEnv* operator->() const { return env_; }

   private:
    EnvGate& g_;
    ChildEnv* env_ = nullptr;
  };

  void expose(const std::string& name, bool anyone, py::object fn) {
    auto ref = std::make_shared<PyRef>(fn);
    Entry env(*gate);
    py::gil_scoped_release nogil;  // registering may wait for the broker thread
    env->expose_encoded(name, anyone ? Allow::kAnyone : Allow::kParent,
                        [ref](const Payload& args) -> Payload {
                          // A worker or serve() thread, never the broker's.
                          // Who called (auth_id): the package unpickles
                          // arguments only from its own family.
                          const auto caller = detail::CallingContext::current();
                          py::gil_scoped_acquire gil;
                          std::string type, message;
                          try {
                            // The package's handler: (True, result bytes) or
                            // (False, (type name, text and traceback)).
                            py::object who = caller ? py::object(py::int_(*caller)) : py::object(py::none());
                            py::tuple r = ref->get()(payload_object(args), who);
                            if (r[0].cast<bool>()) return from_bytes(r[1]);
                            auto failure = r[1].cast<py::tuple>();
                            type = failure[0].cast<std::string>();
                            message = failure[1].cast<std::string>();
                          } catch (py::error_already_set& e) {
                            // Only if the handler itself failed; the Python
                            // error must not outlive the GIL held here.
                            type = "spindle.Error";
                            message = e.what();
                          }
                          // A CallError keeps its type on the wire: the
                          // caller, C++ or Python, sees the Python type.
                          throw CallError(std::move(type), std::move(message));
                        });
  }
  int serve() {
    Entry env(*gate);
    py::gil_scoped_release nogil;
    return env->serve();
  }
  void ready() {
    Entry env(*gate);
    py::gil_scoped_release nogil;
    env->ready();
  }
};

// Runs the package's child main (a Python callable taking a ChildEnv) and
// gives its exit code; a Python exception is printed and exits 1.
int run_python_main(PyObject* main, ChildEnv& env) {
  try {
    py::object rc = py::handle(main)(PyChildEnv{std::make_shared<EnvGate>(&env)});
    return rc.is_none() ? 0 : rc.cast<int>();
  } catch (py::error_already_set& e) {
    if (e.matches(PyExc_SystemExit)) {
      // sys.exit() in the child's main: its code, as the interpreter would
      // give it. Not PyErr_Print(), which would exit() the process from
      // here (atexit handlers, static destructors of the parent's copy).
      py::object code = e.value().attr("code");
      if (code.is_none()) return 0;
      if (PyLong_Check(code.ptr())) return code.cast<int>();
      py::print(code, py::arg("file") = py::module_::import("sys").attr("stderr"));
      return 1;
    }
    e.restore();
    PyErr_Print();
    return 1;
  }
}

struct PyRuntime {
  std::unique_ptr<Runtime> rt;
  RouterOptions child_router;  // its children's: this router's limit and wait_spin

  PyRuntime(std::unique_ptr<Runtime> r, RouterOptions children) : rt(std::move(r)), child_router(std::move(children)) {}
  PyRuntime(PyRuntime&&) = default;
  ~PyRuntime() { destroy_without_gil(rt); }

  Runtime& get() {
    if (!rt) throw py::value_error("spindle: this Router is closed");
    return *rt;
  }
  PyChild fork(py::object main, const std::string& name) {
    Runtime& r = get();
    ChildOptions opts;
    opts.router = child_router;
    opts.name = name;
    // Borrowed: the caller's frame keeps `main` alive across the fork, and
    // a raw pointer can be copied without the GIL's reference counting.
    PyObject* fn = main.ptr();
    ChildMain child_main = [fn](ChildEnv& env) -> int {
      // In the child, on the forking thread, whose thread state held the
      // GIL at the fork: Python's own after-fork work comes first.
      PyOS_AfterFork_Child();
      return run_python_main(fn, env);
    };
    PyOS_BeforeFork();
    try {
      auto c = std::make_unique<Child>(r.fork_child(std::move(child_main), std::move(opts)));
      PyOS_AfterFork_Parent();
      return PyChild{std::move(c)};
    } catch (...) {
      PyOS_AfterFork_Parent();
      throw;
    }
  }
  PyChild spawn(const std::string& program, const std::vector<std::string>& args,
                const std::string& name) {
    Runtime& r = get();
    ChildOptions opts;
    opts.router = child_router;
    opts.name = name;
    py::gil_scoped_release nogil;
    return PyChild{std::make_unique<Child>(r.spawn_child(program, args, std::move(opts)))};
  }
  // A context on another host (<spindle/ssh.h>). `via` is the context the
  // session starts from (a hop), or None for this process. Empty strings
  // and 0 leave SshOptions' defaults; the agent's router takes messages as
  // large as this router's children do.
  PyChild ssh(const std::string& host, SshOptions opts, std::optional<PyContext> via) {
    Runtime& r = get();
    opts.router = child_router;
    if (via) opts.via = via->ctx;
    py::gil_scoped_release nogil;
    return PyChild{std::make_unique<Child>(r.ssh(host, std::move(opts)))};
  }
  void close() {
    std::unique_ptr<Runtime> doomed = std::move(rt);
    py::gil_scoped_release nogil;
    doomed.reset();
  }
  void abandon() { (void)rt.release(); }
};

struct PyConnection {
  std::unique_ptr<Connection> conn;
  std::unique_ptr<ChildEnv> env;  // made on first use; goes before conn
  std::shared_ptr<EnvGate> gate;   // env's, shut before env goes

  PyConnection(std::unique_ptr<Connection> c) : conn(std::move(c)) {}
  PyConnection(PyConnection&&) = default;
  ~PyConnection() {
    destroy_without_gil(env);
    destroy_without_gil(conn);
  }

  Connection& get() {
    if (!conn) throw py::value_error("spindle: this connection is closed");
    return *conn;
  }
  PyChildEnv serving_env() {
    Connection& c = get();
    if (!env) {
      env = std::make_unique<ChildEnv>(c.router(), c.broker());
      gate = std::make_shared<EnvGate>(env.get());
    }
    return PyChildEnv{gate};
  }
  std::vector<PyContext> find(const std::string& pattern) {
    Connection& c = get();
    std::vector<Context> found;
    {
      py::gil_scoped_release nogil;
      found = c.find(pattern);
    }
    std::vector<PyContext> out;
    for (auto& f : found) out.push_back(PyContext{std::move(f)});
    return out;
  }
  void close() {
    std::unique_ptr<ChildEnv> e = std::move(env);
    std::unique_ptr<Connection> doomed = std::move(conn);
    py::gil_scoped_release nogil;
    // Closing ends serve() on any thread; whoever is still inside the env
    // (serve() returning, a ready() in progress) leaves before it is freed.
    if (doomed) doomed->close();
    if (gate) gate->shut_and_wait();
    e.reset();
    doomed.reset();
  }
  void abandon() {
    (void)env.release();
    (void)conn.release();
  }
};

}  // namespace

namespace {

// References dropped without the GIL wait here for the interpreter. One
// pending call drains them all: the interpreter's own queue holds 32 calls,
// and each drop taking a slot of its own leaked every reference past the 32nd
// dropped while the main thread waited (worker threads sending arrays while
// it sat in concurrent.futures.wait(): each array leaked whole). A lock-free
// stack: a drop may happen on any thread, and in a child forked while another
// thread was dropping, no lock is left held.
struct DeferredDecref {
  PyObject* object;
  DeferredDecref* next;
};
std::atomic<DeferredDecref*> g_deferred{nullptr};
std::atomic<bool> g_drain_scheduled{false};

void drain_deferred_decrefs() {
  DeferredDecref* d = g_deferred.exchange(nullptr, std::memory_order_acquire);
  while (d) {
    Py_DECREF(d->object);
    delete std::exchange(d, d->next);
  }
}

int drain_pending(void*) {
  g_drain_scheduled.store(false, std::memory_order_release);
  drain_deferred_decrefs();
  return 0;
}

}  // namespace

PyRef::~PyRef() {
  if (!p_ || !Py_IsInitialized()) return;  // at exit: the interpreter is gone, leak it
  if (PyGILState_Check()) {
    Py_DECREF(p_);
    // Holding the GIL anyway: drop what waits, in case the interpreter's
    // queue was full when the drain was asked for.
    if (g_deferred.load(std::memory_order_relaxed)) drain_deferred_decrefs();
    return;
  }
  // Another thread (the broker's, if the router drops a handler there) must
  // not wait for the GIL: the reference waits for the interpreter's next
  // chance to run a pending call (at most one is asked for at a time).
  auto* d = new DeferredDecref{p_, g_deferred.load(std::memory_order_relaxed)};
  while (!g_deferred.compare_exchange_weak(d->next, d, std::memory_order_release,
                                           std::memory_order_relaxed)) {
  }
  if (!g_drain_scheduled.exchange(true, std::memory_order_acq_rel) &&
      Py_AddPendingCall(drain_pending, nullptr) != 0)
    g_drain_scheduled.store(false, std::memory_order_release);  // full: the next drop asks again
}

void bind_runtime_objects(py::module_& m) {
  py::class_<Completions, std::shared_ptr<Completions>>(m, "Completions")
      .def(py::init<>())
      .def("get", &Completions::get)
      .def("close", &Completions::close);

  py::class_<PyContext>(m, "Context")
      .def_property_readonly("id", [](const PyContext& c) { return c.ctx.id(); })
      .def_property_readonly("name", [](const PyContext& c) { return c.ctx.name(); })
      .def_property_readonly("pid", [](const PyContext& c) { return c.ctx.pid(); })
      .def("call_value", &PyContext::call_value)
      .def("start_call", &PyContext::start_call);

  py::class_<PyChild>(m, "Child")
      .def("context", [](PyChild& c) { return PyContext{c.get().context()}; })
      .def("stop", &PyChild::stop)
      .def("abandon", &PyChild::abandon);

  py::class_<PyChildEnv>(m, "ChildEnv")
      .def_property_readonly("id", [](const PyChildEnv& e) { return PyChildEnv::Entry(*e.gate)->id(); })
      .def_property_readonly("parent_id", [](const PyChildEnv& e) -> std::optional<std::uint32_t> {
        PyChildEnv::Entry env(*e.gate);
        try {
          return env->parent().id();
        } catch (const Error&) {  // a router's client: no parent
          return std::nullopt;
        }
      })
      .def("expose", &PyChildEnv::expose)
      .def("ready", &PyChildEnv::ready)
      .def("serve", &PyChildEnv::serve)
      .def("port", [](PyChildEnv& e) { return make_port(PyChildEnv::Entry(*e.gate)->router()); });

  m.attr("DEFAULT_WAIT_SPIN") = std::chrono::duration<double>(kDefaultWaitSpin).count();
  py::class_<PyRuntime>(m, "Runtime")
      .def(py::init([](std::uint32_t max_message_size, double wait_spin) {
             if (!(wait_spin >= 0 && wait_spin <= 1))
               throw py::value_error("spindle: wait_spin is 0 to 1 seconds");
             RouterOptions opts;
             opts.max_message_size = max_message_size;
             opts.wait_spin = std::chrono::microseconds(static_cast<std::int64_t>(wait_spin * 1e6));
             RouterOptions children = opts;  // its children get the same
             py::gil_scoped_release nogil;
             return PyRuntime{std::make_unique<Runtime>(std::move(opts)), std::move(children)};
           }),
           py::arg("max_message_size"), py::arg("wait_spin"))
      .def_property_readonly("id", [](PyRuntime& r) { return r.get().id(); })
      .def("fork", &PyRuntime::fork)
      .def("spawn", &PyRuntime::spawn)
      .def("ssh",
           [](PyRuntime& r, const std::string& host, const std::string& user, int port,
              const std::string& identity_file, std::vector<std::string> ssh_args,
              double connect_timeout, const std::string& control_path, const std::string& agent,
              const std::string& remote_dir, const std::string& name, std::optional<PyContext> via) {
             if (port < 0 || port > 65535) throw py::value_error("spindle: ssh(port=) is 1 to 65535 (0: ssh's choice)");
             SshOptions opts;
             opts.user = user;
             opts.port = port;
             opts.identity_file = identity_file;
             opts.ssh_args = std::move(ssh_args);
             opts.connect_timeout = to_ms(connect_timeout);
             opts.control_path = control_path;
             opts.agent = agent;
             if (!remote_dir.empty()) opts.remote_dir = remote_dir;
             opts.name = name;
             return r.ssh(host, std::move(opts), std::move(via));
           },
           py::arg("host"), py::arg("user"), py::arg("port"), py::arg("identity_file"),
           py::arg("ssh_args"), py::arg("connect_timeout"), py::arg("control_path"),
           py::arg("agent"), py::arg("remote_dir"), py::arg("name"), py::arg("via"))
      .def("context", [](PyRuntime& r, std::uint32_t id) { return PyContext{r.get().context(id)}; })
      .def("port", [](PyRuntime& r) { return make_port(r.get().router()); })
      // Which link reaches `id` now (Router::fair_share_key): pickle trust
      // is bound to the link a child was started on.
      .def("link_key", [](PyRuntime& r, std::uint32_t id) { return r.get().router().fair_share_key(id); })
      .def("close", &PyRuntime::close)
      .def("abandon", &PyRuntime::abandon);

  py::class_<PyConnection>(m, "Connection")
      .def(py::init([](const std::string& path, const std::string& name, double timeout) {
        ConnectOptions opts;
        opts.name = name;
        opts.timeout = to_ms(timeout);
        py::gil_scoped_release nogil;
        return PyConnection{std::make_unique<Connection>(Connection::open(path, std::move(opts)))};
      }))
      .def_property_readonly("id", [](PyConnection& c) { return c.get().id(); })
      .def("find", &PyConnection::find)
      .def("context", [](PyConnection& c, std::uint32_t id) { return PyContext{c.get().context(id)}; })
      .def("router_context", [](PyConnection& c) { return PyContext{c.get().router_context()}; })
      .def("port", [](PyConnection& c) { return make_port(c.get().router()); })
      .def("env", &PyConnection::serving_env, py::keep_alive<0, 1>())
      .def("close", &PyConnection::close)
      .def("abandon", &PyConnection::abandon);

  m.def(
      "run_spawned_child",
      [](py::object main, std::uint32_t max_message_size) {
        PyObject* fn = main.ptr();  // borrowed: the caller keeps it alive
        RouterOptions opts;
        opts.max_message_size = max_message_size;
        py::gil_scoped_release nogil;
        return run_spawned_child(
            [fn](ChildEnv& env) {
              py::gil_scoped_acquire gil;
              return run_python_main(fn, env);
            },
            std::move(opts));
      },
      py::arg("main"), py::arg("max_message_size") = kDefaultMaxMessageSize);

  // For the tests: drops a reference to each object on a thread without the
  // GIL, as the broker thread drops a sent buffer or a handler, while this
  // thread waits without running Python (as a main thread in a wait does).
  m.def("_release_on_another_thread", [](const py::list& objects) {
    std::vector<std::unique_ptr<PyRef>> refs;
    for (py::handle o : objects) refs.push_back(std::make_unique<PyRef>(o));
    py::gil_scoped_release nogil;
    std::thread([r = std::move(refs)]() mutable { r.clear(); }).join();
  });
}

}  // namespace spindle::python
