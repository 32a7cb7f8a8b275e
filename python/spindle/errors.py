"""Spindle's exceptions, and how a call's failure becomes one.

Re-exported by the package: use spindle.CallError, spindle.ChannelError, ...
Each class says "spindle" as its module, which is also how a Python callee
names them to its caller (CallError.remote_type "spindle.PickleRefusedError").
"""

import builtins
import pickle
import traceback

from . import _spindle

# Separates an exception's text from its traceback in the SE reply of an
# exposed Python function, whose SE type is the exception's type name (a
# C++ caller sees the text and the traceback in CallError::message()).
_TRACEBACK_MARK = "\n\n--- remote traceback ---\n"


class Error(Exception):
    """Base of Spindle's exceptions."""

    __module__ = "spindle"


class CallError(Error):
    """The remote function raised.

    remote_type names the exception's type ("ZeroDivisionError",
    "mypkg.MyError", or a C++ type such as "std::invalid_argument"),
    message is its text and traceback the remote traceback (empty for a C++
    callee).
    """

    __module__ = "spindle"

    def __init__(self, remote_type, message, traceback=""):
        super().__init__(f"{remote_type}: {message}")
        self.remote_type = remote_type
        self.message = message
        self.traceback = traceback


class ChannelError(Error):
    """A dead reply: no such function, refused, or the callee is gone."""

    __module__ = "spindle"


class TimeoutError(Error, builtins.TimeoutError):
    """No answer within the context's timeout."""

    __module__ = "spindle"


class ShutdownError(Error):
    """The Router or Connection the context came from is closed."""

    __module__ = "spindle"


class FdError(ChannelError):
    """File descriptors were lost or refused on the way (a dead reply, PROTOCOL.md 13).

    Most often the receiver was out of file descriptors (at RLIMIT_NOFILE:
    the kernel dropped them, MSG_CTRUNC); the text names the cause. The
    message was not delivered; its sender hears of it through reply_to.
    """

    __module__ = "spindle"


class PickleRefusedError(Error):
    """A pickled value arrived where pickle is not accepted."""

    __module__ = "spindle"


_spindle._set_error_classes(Error, ChannelError, TimeoutError, ShutdownError)


# A buffer this large inside a pickled object (a numpy array's bytes) is not
# put in the pickle stream: it travels beside it, uncopied (ext type 82).
_OUT_OF_BAND_MIN = 1 << 20


def _pickle_dumps(obj):
    """bytes, or (bytes, [PickleBuffer...]) when large buffers go out of band."""
    buffers = []

    def out_of_band(pb):
        try:
            raw = pb.raw()  # only a contiguous buffer can travel as it is
        except BufferError:
            return True
        if raw.nbytes < _OUT_OF_BAND_MIN:
            return True
        buffers.append(pb)
        return False

    data = pickle.dumps(obj, protocol=5, buffer_callback=out_of_band)
    return (data, buffers) if buffers else data


def _refuse_pickle(data, buffers=None):
    raise PickleRefusedError(
        "spindle: refused a pickled value: unpickling runs code, so pickle is "
        "accepted only between a parent and its own children; "
        "spindle.connect(..., allow_pickle=True) accepts it from a router's clients")


class _PickleTrust:
    """Whose pickled values an endpoint unpickles.

    Unpickling runs code, so a pickle is taken only from this process's own
    family: a Router's Python children (fork(), spawn() of spindle.child)
    and itself; a child's parent and itself. Not from an ssh agent, a
    spawn(argv=...) program, a sibling or a router's client, which may all
    run code this process does not control; except where the user opted in
    (everyone: connect(..., allow_pickle=True)). The sender is the frame's
    src_id (a call's callee, a message's sender) or auth_id (an exposed
    function's caller), which the routers on the way have checked against
    the link it came by (the reverse-path check).
    """

    def __init__(self, everyone=False, ids=(), link_key=None):
        self.everyone = everyone
        self.ids = set(ids)
        # A child is trusted through the link it was started on: link_key(id)
        # says which link reaches `id` now. Once the child is gone, its id
        # reaches nothing, or (after the id space wrapped round) another
        # context through another link, which a pickle then does not pass.
        self._link_key = link_key
        self._links = {}

    def add_child(self, cid):
        self.ids.add(cid)
        if self._link_key is not None:
            self._links[cid] = self._link_key(cid)

    def forget_child(self, cid):
        self.ids.discard(cid)
        self._links.pop(cid, None)

    def _trusted(self, sender):
        if sender not in self.ids:
            return False
        want = self._links.get(sender)
        return want is None or self._link_key(sender) == want

    def unpickler(self, sender):
        if self.everyone or self._trusted(sender):
            return pickle.loads
        if not self.ids:  # a Connection without allow_pickle
            return _refuse_pickle

        def refuse(data, buffers=None):
            raise PickleRefusedError(
                f"spindle: refused a pickled value from context {sender}: unpickling runs "
                "code, so pickle is accepted only between a parent and its own Python "
                "children (not from an ssh agent, a spawn(argv=...) program or a sibling)")
        return refuse


def _type_name(exc):
    t = type(exc)
    if t.__module__ == "builtins":
        return t.__qualname__
    return f"{t.__module__}.{t.__qualname__}"


def _format_exception(exc):
    """(type name, text and traceback): what an exposed function's exception answers."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return _type_name(exc), f"{exc}{_TRACEBACK_MARK}{tb}"


def _error_of(kind, a, b):
    """The exception for a call's outcome (kind, a, b) from _spindle."""
    a = a.decode("utf-8", "replace")
    if kind == _spindle.CALL_ERROR:
        message = b.decode("utf-8", "replace")
        text, _, tb = message.partition(_TRACEBACK_MARK)
        return CallError(a, text, tb)
    if kind == _spindle.CHANNEL_ERROR:
        return ChannelError(a)
    if kind == _spindle.TIMEOUT:
        return TimeoutError(a)
    if kind == _spindle.SHUTDOWN:
        return ShutdownError(a)
    return Error(a)


