"""Spindle for Python: calls between processes, in Mitogen's shape.

    import spindle

    def square(n):              # module-level: sent by module and name
        return n * n

    with spindle.Router() as router:
        child = router.fork()                 # or router.spawn(), router.ssh(host)
        child.call(square, 7)                 # 49, run in the child
        child.call_async(square, 3).result()  # a concurrent.futures.Future
        # await child.acall(square, 5)        # in a coroutine

Besides calls, messages: a Receiver on a fresh handle, a Sender to it that
travels as an argument, spindle.Select over several receivers, and file
descriptors that arrive as spindle.Fd objects which close exactly once:

    with router.receiver() as rx:
        child.call(produce, rx.sender)        # produce(sender) calls sender.send(...)
        msg = rx.get(timeout=5)               # msg.data, msg.fds, msg.src_id
        child.send(handle, "hi", fds=[w])     # to a receiver of the child's

The C++ library does the work (one broker thread per process, written in
C++; no Python code ever runs on it). Arguments and results travel as
msgpack, the wire format of the C++ typed calls, so that Python and C++
processes call each other's exposed functions by name. A value msgpack
cannot hold is pickled, which only a parent and its own children accept
from each other: see docs/GUIDE.md, section "Python".
"""

import os
import sys
import weakref

from . import _spindle
from ._calls import (DEFAULT_TIMEOUT, _PY_CALL, Child, Context, _live, _Owner, _py_call)
from ._messages import Fd, Message, Receiver, Select, Sender
from .errors import (CallError, ChannelError, Error, FdError, PickleRefusedError, ShutdownError,
                     TimeoutError, _format_exception, _pickle_dumps, _PickleTrust)

# A writable buffer over a fresh memfd, sent without a copy (binding.h).
Buffer = _spindle.Buffer

__all__ = [
    "Buffer", "CallError", "ChannelError", "ChildEnv", "Connection", "Context", "Child",
    "Error", "Fd", "FdError", "Message", "PickleRefusedError", "Receiver", "Router",
    "Select", "Sender", "ShutdownError", "TimeoutError",
    "DEFAULT_TIMEOUT", "connect", "expose",
]


class ChildEnv:
    """What a child's main gets: expose functions, then serve().

    Valid only while that main runs. Functions run one at a time, in
    arrival order, on the thread that called serve().
    """

    def __init__(self, core, trust, in_child):
        self._core = core
        self._trust = trust  # whose pickles it takes (errors._PickleTrust)
        self._in_child = in_child  # False: a Connection's, serving router clients
        self._names = set()
        self._port = core.port()

    def receiver(self):
        """A Receiver on a fresh handle of this context (see spindle.Receiver)."""
        return Receiver(self._port, self._trust)

    def batch(self):
        """Gathers this thread's sends (ctx.send, Sender.send) until the `with` ends.

            with env.batch():
                for row in rows:
                    sender.send(row)

        They are handed to the broker thread with one wake-up at the end,
        in order (C++ spindle::SendBatch; GUIDE.md, "Sending a burst").
        Calls are not gathered. Do not wait inside the batch for the answer
        to a message it sent: it may not have left yet.
        """
        return self._port.batch()

    @property
    def id(self):
        return self._core.id

    def expose(self, name, fn, anyone=False):
        """Serves fn under `name` ("fn" or "service.fn"), for C++ and Python callers.

        Only the parent may call it unless anyone is true. It takes
        positional msgpack arguments and returns one value.
        """
        trust = self._trust
        port = self._port

        def handler(data, caller):
            try:
                # A Sender argument sends through this context.
                args = _spindle.decode(data, trust, caller, port)
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

        A child also serves module-level functions (ctx.call(fn, ...)) and
        the functions @spindle.expose registered, unless it exposed their
        names itself. A Connection serves what it exposed, nothing else.
        """
        if self._in_child:
            if _PY_CALL not in self._names:
                self.expose(_PY_CALL, _py_call)
            for name, (fn, anyone) in list(_exposed.items()):
                if name not in self._names:
                    self.expose(name, fn, anyone)
        return self._core.serve()


# Functions @spindle.expose registered: name -> (fn, anyone).
_exposed = {}


def expose(name=None, *, anyone=False):
    """Decorator: children serve this function under `name` (default: its __name__).

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
        # Pickles from its parent (and itself) only: an exposed function with
        # anyone=True, or a receiver, may hear from any context.
        family = [core.id] + ([core.parent_id] if core.parent_id is not None else [])
        env = ChildEnv(core, _PickleTrust(ids=family), in_child=True)
        try:
            rc = target(env) if target is not None else env.serve()
            return 0 if rc is None else int(rc)
        finally:
            _flush_stdio()  # a forked child ends with _exit(): nothing else flushes
    return main


class _Endpoint:
    """What Router and Connection share: their core, closing it, and `with`."""

    def _close_core(self):
        self._owner._close_receivers()  # before the router they refer to goes
        self._core.close()
        self._owner._dispatcher.close()

    def _abandon(self):
        """In an os.fork() child: the copies refer to threads that do not exist here."""
        self._owner._closed = True
        self._core.abandon()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def batch(self):
        """Gathers this thread's sends until the `with` ends (see ChildEnv.batch)."""
        self._owner._check()
        return self._owner._port.batch()


# The largest message between a Router and its children (a large buffer
# argument or result is one message): Router(max_message_size=...) changes it.
DEFAULT_MAX_MESSAGE_SIZE = 1 << 30
#: Seconds a waiting thread polls before it sleeps (C++ kDefaultWaitSpin).
DEFAULT_WAIT_SPIN = _spindle.DEFAULT_WAIT_SPIN


class Router(_Endpoint):
    """Spindle in this process: its broker and the children it starts.

        with spindle.Router() as router:
            child = router.fork()

    Closing it stops its children (SHUTDOWN, 5 s, then SIGKILL) and fails
    calls still pending with ShutdownError.
    """

    def __init__(self, *, max_message_size=DEFAULT_MAX_MESSAGE_SIZE, wait_spin=DEFAULT_WAIT_SPIN):
        # Its own children are trusted, and a large array travels as one
        # message (a sealed memfd): hence 1 GiB, not the C++ default 128 MiB.
        # wait_spin (seconds; this router's and its forked children's): a
        # thread waiting for a call's answer, a job or a message polls for up
        # to this long before it sleeps (RouterOptions::wait_spin), or up to
        # four times it when its answers have been taking that long; 0: never.
        self._max_message_size = int(max_message_size)
        self._core = _spindle.Runtime(self._max_message_size, float(wait_spin))
        # Pickles from itself and the Python children it starts (_adopt).
        self._owner = _Owner("Router", _PickleTrust(ids=[self._core.id], link_key=self._core.link_key))
        self._owner._port = self._core.port()
        self._children = []
        _live.add(self)

    @property
    def id(self):
        return self._core.id

    def _adopt(self, core_child, python=False):
        child = Child(core_child, self._owner)
        self._children.append(weakref.ref(child))
        if python:  # runs this package: its pickles are ours
            # ...while the Child owns the process: trust goes with it (the
            # id is never given to another context, but the set must not
            # grow with every child a long-lived router ever forked).
            trust = self._owner._trust
            trust.add_child(child.id)
            child._forget_trust = weakref.finalize(child, trust.forget_child, child.id)
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
        return self._adopt(self._core.fork(_child_main(target), name), python=True)

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
        args = ["-m", "spindle.child", "--max-message-size", str(self._max_message_size)]
        args += ["--main", main] if main else []
        return self._adopt(self._core.spawn(python or sys.executable, args, name), python=True)

    def ssh(self, host, *, user="", port=0, identity_file="", ssh_args=(), connect_timeout=10.0,
            control_path="", agent="", remote_dir="", name="", via=None):
        """Starts a context on `host` over OpenSSH and returns its Child.

        The remote side runs spindle-agent (a C++ program: it serves
        functions by name, such as child.call("spindle.echo", "hi") and
        "spindle.info", not Python functions), uploaded through the same
        session if the host lacks this build's (docs/REMOTE.md). user, port
        and identity_file are ssh's -l, -p and -i; ssh_args go to ssh as
        they are (a list: ["-o", "Option=value", ...]); connect_timeout
        (seconds) bounds the whole start; control_path reuses a
        ControlMaster; agent is the binary to run there (default:
        $SPINDLE_AGENT, else the installed one); remote_dir is where the host
        caches agents (relative: below its $HOME; default .cache/spindle);
        via is a context an earlier ssh() returned, to start this one from
        (a hop). BatchMode is on: a refused login raises spindle.Error with
        ssh's own message instead of prompting for a password.
        """
        self._owner._check()
        if isinstance(ssh_args, (str, bytes)):
            raise TypeError("spindle: ssh(ssh_args=...) is a list of arguments, not one string")
        if via is not None:
            if not isinstance(via, Context):
                raise TypeError(f"spindle: ssh(via=...) takes a Context, not {via!r}")
            if via._owner is not self._owner:
                raise ValueError("spindle: ssh(via=...) takes a context of this Router")
        fspath = lambda p: os.fspath(p) if p else ""  # noqa: E731 - paths may be PathLike
        return self._adopt(self._core.ssh(
            str(host), user or "", int(port or 0), fspath(identity_file),
            [str(a) for a in ssh_args], float(connect_timeout), fspath(control_path),
            fspath(agent), fspath(remote_dir), name or "", via._core if via is not None else None))

    def context(self, context_id):
        """Another context by id (a sibling): not owned."""
        self._owner._check()
        return Context(self._core.context(context_id), self._owner)

    def receiver(self):
        """A Receiver on a fresh handle of this router (closed with it)."""
        return self._owner._receiver()

    def close(self):
        """Stops the children, then the broker. Idempotent."""
        if self._owner._closed:
            return
        self._owner._closed = True
        for ref in self._children:
            child = ref()
            if child is not None:
                child.stop()
        self._close_core()


class Connection(_Endpoint):
    """This process as a client of a spindle-router (see connect())."""

    def __init__(self, path="", *, name=None, allow_pickle=False, timeout=10.0):
        self._core = _spindle.Connection(path, name or "", timeout)
        self._owner = _Owner("Connection", _PickleTrust(everyone=allow_pickle))
        self._owner._port = self._core.port()
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

    def receiver(self):
        """A Receiver on a fresh handle of this client (closed with it)."""
        return self._owner._receiver()

    def _serving_env(self):
        if self._env is None:
            self._env = ChildEnv(self._core.env(), self._owner._trust, in_child=False)
        return self._env

    def expose(self, name, fn, anyone=False):
        """Serves fn under `name`; other clients need anyone=True."""
        self._owner._check()
        self._serving_env().expose(name, fn, anyone)

    def ready(self):
        """Declares the functions exposed before serving: calls to them wait for serve()."""
        self._owner._check()
        self._serving_env().ready()

    def serve(self):
        """Serves exposed functions until the router goes away or close()."""
        self._owner._check()
        return self._serving_env().serve()

    def close(self):
        """Closes the link (queued messages are flushed first). Idempotent."""
        if self._owner._closed:
            return
        self._owner._closed = True
        self._close_core()


def connect(path="", *, name=None, allow_pickle=False, timeout=10.0):
    """Connects to the spindle-router at `path` ("" for the per-user default).

    name registers this client under a name others find(). Pickled values
    from the router's clients are refused unless allow_pickle is true
    (unpickling is code execution).
    """
    return Connection(path, name=name, allow_pickle=allow_pickle, timeout=timeout)
