"""Spindle for Python: calls between processes, in Mitogen's shape.

    import spindle

    def square(n):              # module-level: sent by module and name
        return n * n

    with spindle.Router() as router:
        child = router.fork()                 # or router.spawn()
        child.call(square, 7)                 # 49, run in the child
        child.call_async(square, 3).result()  # a concurrent.futures.Future
        # await child.acall(square, 5)        # in a coroutine

The C++ library does the work (one broker thread per process, written in
C++; no Python code ever runs on it). Arguments and results travel as
msgpack, the wire format of the C++ typed calls, so that Python and C++
processes call each other's exposed functions by name. A value msgpack
cannot hold is pickled, which only a parent and its own children accept
from each other: see docs/GUIDE.md, section "Python".
"""

import asyncio
import builtins
import concurrent.futures
import importlib
import itertools
import os
import pickle
import sys
import threading
import traceback
import weakref

from . import _spindle

__all__ = [
    "CallError", "ChannelError", "ChildEnv", "Connection", "Context", "Child",
    "Error", "PickleRefusedError", "Router", "ShutdownError", "TimeoutError",
    "connect", "expose",
]

#: Seconds a call waits for its answer unless told otherwise.
DEFAULT_TIMEOUT = 30.0

# The method a child serves "call this module-level function" under.
_PY_CALL = "py.call"
# Separates an exception's text from its traceback in the SE reply of an
# exposed Python function (a C++ caller sees both in CallError::message()).
_TRACEBACK_MARK = "\n\n--- remote traceback ---\n"


class Error(Exception):
    """Base of Spindle's exceptions."""


class CallError(Error):
    """The remote function raised.

    remote_type names the exception's type ("ZeroDivisionError",
    "mypkg.MyError", or a C++ type such as "std::invalid_argument"),
    message is its text and traceback the remote traceback (empty for a C++
    callee).
    """

    def __init__(self, remote_type, message, traceback=""):
        super().__init__(f"{remote_type}: {message}")
        self.remote_type = remote_type
        self.message = message
        self.traceback = traceback


class ChannelError(Error):
    """A dead reply: no such function, refused, or the callee is gone."""


class TimeoutError(Error, builtins.TimeoutError):
    """No answer within the context's timeout."""


class ShutdownError(Error):
    """The Router or Connection the context came from is closed."""


class PickleRefusedError(Error):
    """A pickled value arrived where pickle is not accepted."""


_spindle._set_error_classes(Error, ChannelError, TimeoutError, ShutdownError)


def _pickle_dumps(obj):
    return pickle.dumps(obj, protocol=5)


def _refuse_pickle(data):
    raise PickleRefusedError(
        "spindle: refused a pickled value: unpickling runs code, so pickle is "
        "accepted only between a parent and its own children; "
        "spindle.connect(..., allow_pickle=True) accepts it from a router's clients")


def _type_name(exc):
    t = type(exc)
    if t.__module__ == "builtins":
        return t.__qualname__
    return f"{t.__module__}.{t.__qualname__}"


def _format_exception(exc):
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return f"{_type_name(exc)}: {exc}{_TRACEBACK_MARK}{tb}"


def _error_of(kind, a, b):
    """The exception for a call's outcome (kind, a, b) from _spindle."""
    a = a.decode("utf-8", "replace")
    if kind == _spindle.CALL_ERROR:
        message = b.decode("utf-8", "replace")
        if a == _spindle.PYTHON_EXCEPTION_TYPE:
            head, _, tb = message.partition(_TRACEBACK_MARK)
            remote_type, _, text = head.partition(": ")
            return CallError(remote_type, text, tb)
        return CallError(a, message)
    if kind == _spindle.CHANNEL_ERROR:
        return ChannelError(a)
    if kind == _spindle.TIMEOUT:
        return TimeoutError(a)
    if kind == _spindle.SHUTDOWN:
        return ShutdownError(a)
    return Error(a)


def _function_address(fn):
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if (not callable(fn) or not module or not qualname
            or "<locals>" in qualname or "<lambda>" in qualname):
        raise TypeError(
            "spindle: call() takes a module-level function (sent by module and "
            f"qualified name) or the name of an exposed function, not {fn!r}")
    return module, qualname


def _py_call(module, qualname, args, kwargs):
    """Runs module.qualname(*args, **kwargs) in the child (the "py.call" method)."""
    obj = importlib.import_module(module)
    try:
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        where = ("a spawned child runs spindle.child as __main__, not the "
                 "parent's script: put the function in a module"
                 if module == "__main__" else "no such attribute")
        raise AttributeError(f"spindle: cannot find {module}.{qualname} in the child ({where})") from None
    return obj(*args, **(kwargs or {}))


# Every live Router, Connection and Child, for the after-fork hook below.
_live = weakref.WeakSet()


def _after_fork_in_child():
    # A forked child (os.fork, or router.fork) holds copies of the parent's
    # runtimes, whose threads do not exist here: their destructors would
    # wait for them. They are abandoned (leaked) instead; the child makes
    # its own Router if it wants one.
    for obj in list(_live):
        obj._abandon()


os.register_at_fork(after_in_child=_after_fork_in_child)


class _Dispatcher:
    """Completes the futures of asynchronous calls, on a Python thread.

    The broker thread only queues a completion (C++); this thread takes it
    and sets the future, so future callbacks run here and never on the
    broker thread.
    """

    def __init__(self, decode):
        self.queue = _spindle.Completions()
        self._decode = decode
        self._pending = {}
        self._lock = threading.Lock()
        self._tokens = itertools.count(1)
        self._thread = threading.Thread(target=self._run, name="spindle-completions", daemon=True)
        self._thread.start()

    def register(self, future):
        with self._lock:
            token = next(self._tokens)
            self._pending[token] = future
        return token

    def forget(self, token):
        with self._lock:
            self._pending.pop(token, None)

    def _run(self):
        while True:
            item = self.queue.get()
            if item is None:
                return
            token, outcome = item
            with self._lock:
                future = self._pending.pop(token, None)
            if future is None or not future.set_running_or_notify_cancel():
                continue  # cancelled: the answer is dropped
            try:
                result = self._decode(outcome)
            except BaseException as exc:  # noqa: B902 - it belongs to the caller
                future.set_exception(exc)
            else:
                future.set_result(result)

    def close(self):
        self.queue.close()  # the thread drains what is queued, then ends
        if self._thread is not threading.current_thread():
            self._thread.join()


class _Owner:
    """What a Router and a Connection share: decoding and futures."""

    def __init__(self, allow_pickle):
        self._unpickler = pickle.loads if allow_pickle else _refuse_pickle
        self._dispatcher = _Dispatcher(self._decode)
        self._closed = False

    def _decode(self, outcome):
        kind, a, b = outcome
        if kind == _spindle.OK:
            return _spindle.unpack(a, self._unpickler)
        raise _error_of(kind, a, b)

    def _check(self):
        if self._closed:
            raise ShutdownError(f"spindle: this {type(self).__name__} is closed")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Context:
    """A handle on another context: calls it.

    Cheap to copy; any thread may use it. A call raises CallError (the
    remote function raised), ChannelError (no such function, refused, the
    callee died), TimeoutError or ShutdownError.
    """

    def __init__(self, core, owner, timeout=DEFAULT_TIMEOUT):
        self._core = core
        self._owner = owner
        self._timeout = timeout

    id = property(lambda self: self._core.id, doc="The context's id.")
    name = property(lambda self: self._core.name, doc="The context's name.")
    pid = property(lambda self: self._core.pid, doc="Its pid if a child process of this one, else 0.")
    timeout = property(lambda self: self._timeout, doc="Seconds its calls wait.")

    def __repr__(self):
        return f"<spindle.{type(self).__name__} {self.name!r} id={self.id}>"

    def with_timeout(self, seconds):
        """The same context, whose calls wait `seconds` for their answer."""
        return Context(self._core, self._owner, seconds)

    def _request(self, fn, args, kwargs):
        if isinstance(fn, str):
            if kwargs:
                raise TypeError("spindle: a function called by name takes positional "
                                "arguments only (typed calls have no keywords)")
            return fn, _spindle.pack(list(args), _pickle_dumps)
        module, qualname = _function_address(fn)
        return _PY_CALL, _spindle.pack([module, qualname, list(args), kwargs], _pickle_dumps)

    def call(self, fn, *args, **kwargs):
        """Runs fn(*args, **kwargs) in the context and returns its result.

        fn is a module-level function (imported in the child by module and
        qualified name) or the name of a function the context exposed (in
        C++ or Python; positional arguments only). The GIL is released while
        the call waits.
        """
        self._owner._check()
        name, data = self._request(fn, args, kwargs)
        return self._owner._decode(self._core.call(name, data, self._timeout))

    def call_async(self, fn, *args, **kwargs):
        """call(), returning a concurrent.futures.Future at once."""
        self._owner._check()
        name, data = self._request(fn, args, kwargs)
        future = concurrent.futures.Future()
        dispatcher = self._owner._dispatcher
        token = dispatcher.register(future)
        try:
            self._core.start_call(name, data, self._timeout, dispatcher.queue, token)
        except BaseException:
            dispatcher.forget(token)
            raise
        return future

    async def acall(self, fn, *args, **kwargs):
        """call() for asyncio: `await ctx.acall(fn, ...)`."""
        return await asyncio.wrap_future(self.call_async(fn, *args, **kwargs))


class Child(Context):
    """A child process's context, which owns the process.

    stop() (or closing the Router) asks it to shut down, waits up to 5 s,
    then kills and reaps it.
    """

    def __init__(self, core_child, owner):
        super().__init__(core_child.context(), owner)
        self._child = core_child
        _live.add(self)

    def stop(self):
        """Shuts the child down and returns its wait status (os.waitstatus_to_exitcode)."""
        return self._child.stop()

    def _abandon(self):
        self._child.abandon()


class ChildEnv:
    """What a child's main gets: expose functions, then serve().

    Valid only while that main runs. Functions run one at a time, in
    arrival order, on the thread that called serve().
    """

    def __init__(self, core, unpickler, serves_py_calls):
        self._core = core
        self._unpickler = unpickler
        self._serves_py_calls = serves_py_calls
        self._names = set()

    @property
    def id(self):
        return self._core.id

    def expose(self, name, fn, anyone=False):
        """Serves fn under `name` ("fn" or "service.fn"), for C++ and Python callers.

        Only the parent may call it unless anyone is true. It takes
        positional msgpack arguments and returns one value.
        """
        unpickler = self._unpickler

        def handler(data):
            try:
                args = _spindle.unpack(data, unpickler)
                if not isinstance(args, list):
                    raise TypeError("spindle: the arguments are not a msgpack array")
                return True, _spindle.pack(fn(*args), _pickle_dumps)
            except BaseException as exc:  # noqa: B902 - it goes back to the caller
                return False, _format_exception(exc)

        self._core.expose(name, bool(anyone), handler)
        self._names.add(name)

    def ready(self):
        """Declares the functions exposed, without serving (calls wait until then)."""
        self._core.ready()

    def serve(self):
        """Serves until the parent says SHUTDOWN or goes away; returns 0.

        Functions registered with @spindle.expose are served too, and in a
        child, module-level functions (ctx.call(fn, ...)).
        """
        if self._serves_py_calls and _PY_CALL not in self._names:
            self.expose(_PY_CALL, _py_call)
        for name, (fn, anyone) in list(_exposed.items()):
            if name not in self._names:
                self.expose(name, fn, anyone)
        return self._core.serve()


# Functions @spindle.expose registered: name -> (fn, anyone).
_exposed = {}


def expose(name=None, *, anyone=False):
    """Decorator: a child serves this function under `name` (default: its __name__).

        @spindle.expose("square")
        def square(n): return n * n
    """
    def register(fn):
        _exposed[name or fn.__name__] = (fn, anyone)
        return fn
    return register


def _flush_stdio():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass


def _child_main(target):
    """The C++ child main: a ChildEnv for `core`, then target(env) or serve()."""
    def main(core):
        env = ChildEnv(core, pickle.loads, serves_py_calls=True)
        try:
            rc = target(env) if target is not None else env.serve()
            return 0 if rc is None else int(rc)
        finally:
            _flush_stdio()  # a forked child ends with _exit(): nothing else flushes
    return main


class Router:
    """Spindle in this process: its broker and the children it starts.

        with spindle.Router() as router:
            child = router.fork()

    Closing it stops its children (SHUTDOWN, 5 s, then SIGKILL) and fails
    calls still pending with ShutdownError.
    """

    def __init__(self):
        self._core = _spindle.Runtime()
        self._owner = _Owner(allow_pickle=True)  # its own children only
        self._children = []
        _live.add(self)

    @property
    def id(self):
        return self._core.id

    def _adopt(self, core_child):
        child = Child(core_child, self._owner)
        self._children.append(weakref.ref(child))
        return child

    def fork(self, target=None, *, name=""):
        """Forks a child context and returns its Child.

        The child serves module-level functions and @spindle.expose'd ones;
        or it runs target(env) (a ChildEnv: expose, then env.serve()) and
        exits with what it returns. Hold no locks other threads need: as
        with os.fork, only the forking thread exists in the child.
        """
        self._owner._check()
        _flush_stdio()
        return self._adopt(self._core.fork(_child_main(target), name))

    def spawn(self, *, name="", python=None, main=None, argv=None):
        """Starts `python -m spindle.child` (a fresh interpreter) and returns its Child.

        python defaults to this interpreter (sys.executable). main, as
        "module:function", is run as function(env) instead of serving.
        argv starts another program instead, such as a C++ one that calls
        spindle::run_spawned_child(): [path, arguments...].
        """
        self._owner._check()
        if argv is not None:
            if not argv:
                raise ValueError("spindle: spawn(argv=...) needs at least the program's path")
            return self._adopt(self._core.spawn(os.fspath(argv[0]), [str(a) for a in argv[1:]], name))
        args = ["-m", "spindle.child"] + (["--main", main] if main else [])
        return self._adopt(self._core.spawn(python or sys.executable, args, name))

    def context(self, context_id):
        """Another context by id (a sibling): not owned."""
        self._owner._check()
        return Context(self._core.context(context_id), self._owner)

    def close(self):
        """Stops the children, then the broker. Idempotent."""
        if self._owner._closed:
            return
        self._owner._closed = True
        for ref in self._children:
            child = ref()
            if child is not None:
                child.stop()
        self._core.close()
        self._owner._dispatcher.close()

    def _abandon(self):
        self._owner._closed = True
        self._core.abandon()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Connection:
    """This process as a client of a spindle-router (see connect())."""

    def __init__(self, path="", *, name=None, allow_pickle=False, timeout=10.0):
        self._core = _spindle.Connection(path, name or "", timeout)
        self._owner = _Owner(allow_pickle)
        self._allow_pickle = allow_pickle
        self._env = None
        _live.add(self)

    @property
    def id(self):
        return self._core.id

    def find(self, pattern):
        """The clients whose names match the glob `pattern`, sorted by name."""
        self._owner._check()
        return [Context(c, self._owner) for c in self._core.find(pattern)]

    def context(self, context_id):
        """Another client, by the id the router assigned it."""
        self._owner._check()
        return Context(self._core.context(context_id), self._owner)

    def router_context(self):
        """The spindle-router's own context."""
        self._owner._check()
        return Context(self._core.router_context(), self._owner)

    def _serving_env(self):
        if self._env is None:
            unpickler = pickle.loads if self._allow_pickle else _refuse_pickle
            self._env = ChildEnv(self._core.env(), unpickler, serves_py_calls=False)
        return self._env

    def expose(self, name, fn, anyone=False):
        """Serves fn under `name`; other clients need anyone=True."""
        self._owner._check()
        self._serving_env().expose(name, fn, anyone)

    def ready(self):
        self._serving_env().ready()

    def serve(self):
        """Serves exposed functions until the router goes away or close()."""
        return self._serving_env().serve()

    def close(self):
        """Closes the link (queued messages are flushed first). Idempotent."""
        if self._owner._closed:
            return
        self._owner._closed = True
        self._core.close()
        self._owner._dispatcher.close()

    def _abandon(self):
        self._owner._closed = True
        self._core.abandon()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def connect(path="", *, name=None, allow_pickle=False, timeout=10.0):
    """Connects to the spindle-router at `path` ("" for the per-user default).

    name registers this client under a name others find(). Pickled values
    from the router's clients are refused unless allow_pickle is true
    (unpickling is code execution).
    """
    return Connection(path, name=name, allow_pickle=allow_pickle, timeout=timeout)
