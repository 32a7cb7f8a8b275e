"""Contexts and the machinery of calls: futures, decoding, the fork hook.

Internal to the package: use spindle.Context and spindle.Child.
"""

import asyncio
import concurrent.futures
import importlib
import itertools
import os
import sys
import threading
import weakref

from . import _spindle
from ._messages import Receiver, _send
from ._messages import _live as _live_messages
from .errors import ShutdownError, _error_of, _pickle_dumps

#: Seconds a call waits for its answer unless told otherwise.
DEFAULT_TIMEOUT = 30.0

# The method a child serves "call this module-level function" under.
_PY_CALL = "py.call"


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
    # What import_module does first, without its cost (a quarter of this
    # function's): a module in sys.modules whose import has ended.
    obj = sys.modules.get(module)
    if obj is None or getattr(getattr(obj, "__spec__", None), "_initializing", False):
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
    for obj in list(_live_messages) + list(_live):
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

    def register(self, future, callee):
        with self._lock:
            token = next(self._tokens)
            self._pending[token] = (future, callee)
        return token

    def forget(self, token):
        with self._lock:
            self._pending.pop(token, None)

    def _run(self):
        while True:
            batch = self.queue.get()  # every completion queued so far
            if batch is None:
                return
            with self._lock:
                pops = [self._pending.pop(token, (None, 0)) for token, _ in batch]
            for (future, callee), (_, outcome) in zip(pops, batch):
                if future is None or not future.set_running_or_notify_cancel():
                    continue  # cancelled: the answer is dropped
                try:
                    result = self._decode(outcome, callee)
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

    def __init__(self, label, trust):
        self._label = label  # "Router" or "Connection", for errors
        self._trust = trust  # whose pickles it takes (a Router adds its children)
        self._dispatcher = _Dispatcher(self._decode)
        self._closed = False
        self._port = None  # set by the Router or Connection: sends, makes receivers
        self._receivers = weakref.WeakSet()

    def _decode(self, outcome, callee):
        kind, a, b = outcome
        if kind == _spindle.OK:
            # A Sender in the result sends through this router.
            return _spindle.decode(a, self._trust, callee, self._port)
        raise _error_of(kind, a, b)

    def _receiver(self):
        self._check()
        rx = Receiver(self._port, self._trust)
        self._receivers.add(rx)
        return rx

    def _close_receivers(self):
        for rx in list(self._receivers):
            rx.close()

    def _check(self):
        if self._closed:
            raise ShutdownError(f"spindle: this {self._label} is closed (or was inherited "
                                "through a fork: make a new one in the child)")


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
        """The method's name and the request's value, not yet packed."""
        if isinstance(fn, str):
            if kwargs:
                raise TypeError("spindle: a function called by name takes positional "
                                "arguments only (typed calls have no keywords)")
            return fn, list(args)
        module, qualname = _function_address(fn)
        return _PY_CALL, [module, qualname, list(args), kwargs]

    def call(self, fn, *args, **kwargs):
        """Runs fn(*args, **kwargs) in the context and returns its result.

        fn is a module-level function (imported in the child by module and
        qualified name) or the name of a function the context exposed (in
        C++ or Python; positional arguments only). The GIL is released while
        the call waits.
        """
        owner = self._owner
        owner._check()
        name, value = self._request(fn, args, kwargs)
        # Packed, called and decoded in one step (_Owner._decode's work).
        kind, a, b = self._core.call_value(name, value, _pickle_dumps, self._timeout,
                                           owner._trust, owner._port)
        if kind == _spindle.OK:
            return a
        raise _error_of(kind, a, b)

    def call_async(self, fn, *args, **kwargs):
        """call(), returning a concurrent.futures.Future at once."""
        self._owner._check()
        name, value = self._request(fn, args, kwargs)
        data = _spindle.pack(value, _pickle_dumps)
        future = concurrent.futures.Future()
        dispatcher = self._owner._dispatcher
        token = dispatcher.register(future, self.id)
        try:
            self._core.start_call(name, data, self._timeout, dispatcher.queue, token)
        except BaseException:
            dispatcher.forget(token)
            raise
        return future

    async def acall(self, fn, *args, **kwargs):
        """call() for asyncio: `await ctx.acall(fn, ...)`."""
        return await asyncio.wrap_future(self.call_async(fn, *args, **kwargs))

    def send(self, handle, value, *, fds=None, reply_to=None):
        """Sends value to `handle` of the context: fire-and-forget.

        value is packed as a call argument is. fds (ints or objects with
        fileno(), 253 at most) travel as duplicates: the caller keeps its
        own. If the message is refused (no such handle, a closed receiver,
        fds lost), a dead reply goes to reply_to (a Receiver of this
        router), whose get() raises ChannelError or FdError; without
        reply_to nobody hears of it.
        """
        self._owner._check()
        _send(self._owner._port, self.id, handle, value, fds, reply_to)


class Child(Context):
    """A child process's context, which owns the process.

    stop() (or closing the Router) asks it to shut down, waits up to 5 s,
    then kills and reaps it.
    """

    def __init__(self, core_child, owner):
        super().__init__(core_child.context(), owner)
        self._child = core_child
        _live.add(self)

    _forget_trust = None  # set by Router._adopt for a Python child

    def stop(self):
        """Shuts the child down and returns its wait status (os.waitstatus_to_exitcode)."""
        status = self._child.stop()
        if self._forget_trust is not None:
            self._forget_trust()  # its pickles are no longer taken
        return status

    def _abandon(self):
        self._child.abandon()


