"""Messages: ctx.send(), Receiver, Select, Sender, Message and Fd.

Internal to the package: use spindle.Receiver, spindle.Select, ...

One mechanism underneath (python/messages.cpp): every Receiver is a
receiver of the C++ library's Select (services/select.h). A Receiver alone
is a Select of one; Select([rx, ...]) moves each receiver into its own
Select on the broker thread, keeping what was queued. A message's value is
msgpack, packed as a call argument is (pickle for what msgpack cannot hold,
accepted only where the owner accepts pickle). A dead message (the library
refused it: no such handle, receiver closed, fds lost) raises ChannelError
from get(), FdError when fds were the cause; it reaches a sender that gave
send(..., reply_to=rx).
"""

import os
import weakref

from . import _spindle
from .errors import ChannelError, FdError, ShutdownError, TimeoutError, _pickle_dumps

# The library's dead-reply reasons that mean fds were lost or refused
# (stream/fd_frame.h, router/reasons.h; PROTOCOL.md section 13).
_FD_REASONS = (
    "receiver out of file descriptors",
    "peer cannot take file descriptors",
    "too many file descriptors",
    "cannot send file descriptors",
    "fd quota exceeded",
)

# Receivers and Selects alive, for the after-fork hook (_calls.py).
_live = weakref.WeakSet()

def _fd_numbers(fds):
    """The ints of `fds` (ints or objects with fileno()), checked before anything is sent."""
    if fds is None:
        return []
    try:
        items = list(fds)
    except TypeError:
        raise TypeError(f"spindle: fds takes a list of ints or objects with fileno(), not {fds!r}") from None
    if len(items) > _spindle.MAX_FDS_PER_MESSAGE:
        raise ValueError(f"spindle: {len(items)} fds exceed the limit of "
                         f"{_spindle.MAX_FDS_PER_MESSAGE} per message (SCM_MAX_FD): send several messages")
    out = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int):
            fileno = getattr(item, "fileno", None)
            if fileno is None:
                raise TypeError(f"spindle: an fd is an int or has fileno(), not {item!r}")
            item = fileno()
            if isinstance(item, bool) or not isinstance(item, int):
                raise TypeError(f"spindle: fileno() returned {item!r}, not an int")
        if item < 0:
            raise ValueError(f"spindle: {item} is not a file descriptor")
        try:
            os.fstat(item)
        except OSError as e:
            raise ValueError(f"spindle: fd {item} cannot be sent: {e.strerror}") from None
        out.append(item)
    return out


def _send(port, dst, handle, value, fds, reply_to):
    numbers = _fd_numbers(fds)
    if isinstance(reply_to, Receiver):
        reply_to = reply_to.handle
    data = _spindle.pack(value, _pickle_dumps)
    try:
        port.send(dst, int(handle), data, numbers, int(reply_to or 0))
    except OSError as e:
        raise FdError(f"spindle: cannot duplicate the fds to send: {e.strerror}") from None


class Fd:
    """A received file descriptor, closed exactly once.

    fileno() gives the number; detach() gives it up (the caller then owns
    and closes it); close() closes it (idempotent), as does `with` or, if
    neither happened, garbage collection.
    """

    __slots__ = ("_box", "__weakref__")

    def __init__(self, fd):
        self._box = [fd]  # list.pop() is atomic: one closer wins

    def fileno(self):
        try:
            return self._box[0]
        except IndexError:
            raise ValueError("spindle: this Fd is closed or detached") from None

    @property
    def closed(self):
        return not self._box

    def detach(self):
        """The fd number, which the caller now owns; this Fd is closed without closing it."""
        try:
            return self._box.pop()
        except IndexError:
            raise ValueError("spindle: this Fd is closed or detached") from None

    def close(self):
        try:
            fd = self._box.pop()
        except IndexError:
            return
        os.close(fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except OSError:
            pass

    def __repr__(self):
        return f"<spindle.Fd {self._box[0] if self._box else 'closed'}>"


class Message:
    """A message a Receiver got: data (the value), fds (spindle.Fd), src_id, handle, receiver."""

    __slots__ = ("data", "fds", "src_id", "handle", "reply_to", "receiver")

    def __init__(self, data, fds, src_id, handle, reply_to, receiver):
        self.data = data
        self.fds = fds
        self.src_id = src_id
        self.handle = handle
        self.reply_to = reply_to
        self.receiver = receiver

    def __repr__(self):
        return (f"<spindle.Message from {self.src_id} on handle {self.handle}: "
                f"{self.data!r}{f', {len(self.fds)} fds' if self.fds else ''}>")


def _message(item, receiver):
    """A Message from the C++ tuple, or the error a dead message means."""
    _serial, handle, src_id, reply_to, dead, data, fds = item
    fds = [Fd(n) for n in fds]
    if dead is not None:
        for f in fds:
            f.close()
        if any(dead.startswith(r) for r in _FD_REASONS):
            raise FdError(dead)
        raise ChannelError(dead)
    value = _spindle.decode(data, receiver._trust, src_id, receiver._port)
    return Message(value, fds, src_id, handle, reply_to, receiver)


def _timeout_arg(timeout):
    if timeout is None:
        return -1.0
    timeout = float(timeout)
    if timeout < 0:
        raise ValueError("spindle: a timeout is a number of seconds >= 0, or None")
    return timeout


class Sender:
    """The address of a Receiver: (context id, handle). Passes as an argument; send() sends to it."""

    __slots__ = ("context_id", "handle", "_port")

    def __init__(self, context_id, handle, port=None):
        self.context_id = int(context_id)
        self.handle = int(handle)
        self._port = port

    def send(self, value, fds=None, *, reply_to=None):
        """Sends value (and duplicates of fds) to the receiver; fire-and-forget."""
        if self._port is None:
            raise ShutdownError("spindle: this Sender was not unpacked inside a Spindle call "
                                "or message, so it has no router to send through")
        _send(self._port, self.context_id, self.handle, value, fds, reply_to)

    def __reduce__(self):
        return (_sender, (self.context_id, self.handle))

    def __eq__(self, other):
        return isinstance(other, Sender) and (self.context_id, self.handle) == (other.context_id, other.handle)

    def __hash__(self):
        return hash((self.context_id, self.handle))

    def __repr__(self):
        return f"<spindle.Sender context {self.context_id} handle {self.handle}>"


def _sender(context_id, handle):
    """Unpickles a Sender, bound to the router it is unpacked by."""
    return Sender(context_id, handle, _spindle._decoding_port())


class _Waiting:
    """What Receiver and Select share: iteration until closed, and `with`."""

    def __iter__(self):
        while True:
            try:
                yield self.get()
            except ChannelError:
                if self._closed:
                    return
                raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Receiver(_Waiting):
    """Messages sent to a fresh handle of this router (router.receiver(), env.receiver()).

    get(timeout=None) returns the next Message; `for msg in rx` iterates
    until close(). Others send to rx.sender (or to (rx.context_id,
    rx.handle)). close() (or leaving `with`) gives the handle back: later
    messages get a dead reply.
    """

    def __init__(self, port, trust):
        self._port = port
        self._trust = trust  # whose pickles it takes (errors._PickleTrust)
        self._core = port.receiver()
        self._select = None
        self._closed = False
        _live.add(self)

    handle = property(lambda self: self._core.handle, doc="The handle messages arrive on.")
    context_id = property(lambda self: self._core.context_id, doc="This router's context id.")
    closed = property(lambda self: self._closed)

    @property
    def sender(self):
        """A Sender to this receiver, for passing to other contexts."""
        return Sender(self.context_id, self.handle, self._port)

    def get(self, timeout=None):
        """The next Message; spindle.TimeoutError after `timeout` seconds (None: wait).

        Raises ChannelError if the receiver is closed, or for a dead message
        (FdError when lost fds caused it). The GIL is released while it waits.
        """
        if self._closed:
            raise ChannelError("spindle: the receiver is closed")
        if self._select is not None:
            raise ValueError("spindle: this receiver belongs to a Select: get() from the Select")
        item = self._core.get(_timeout_arg(timeout))
        if item is None:
            if self._closed or self._select is not None:
                raise ChannelError("spindle: the receiver was closed (or moved into a Select) while waiting")
            raise TimeoutError(f"spindle: no message on handle {self.handle} within {timeout} s")
        return _message(item, self)

    def close(self):
        """Gives the handle back (idempotent); queued and later messages get a dead reply."""
        if self._closed:
            return
        self._closed = True
        self._core.close()

    def _abandon(self):
        self._closed = True
        self._core.abandon()

    def __repr__(self):
        return f"<spindle.Receiver context {self.context_id} handle {self.handle}>"


class Select(_Waiting):
    """Waits on several receivers: get() returns the next Message from any of them.

        with spindle.Select([rx1, rx2]) as sel:
            msg = sel.get(timeout=5)   # msg.receiver says which

    Receivers take turns (the library's fairness rule), so a flooded one
    cannot hide another's messages. A receiver belongs to one Select at most;
    get() it from there. close() closes the Select and its receivers.
    """

    def __init__(self, receivers=()):
        self._core = _spindle.SelectCore()
        self._receivers = {}  # serial -> Receiver
        self._closed = False
        _live.add(self)
        for rx in receivers:
            self.add(rx)

    def add(self, receiver):
        """Adds a receiver; what it had queued comes first, in order."""
        if self._closed:
            raise ChannelError("spindle: the Select is closed")
        if not isinstance(receiver, Receiver):
            raise TypeError(f"spindle: Select takes Receivers, not {receiver!r}")
        if receiver._select is self:
            return
        if receiver._select is not None:
            raise ValueError("spindle: this receiver already belongs to another Select")
        if receiver._closed:
            raise ChannelError("spindle: the receiver is closed")
        receiver._core.move_to(self._core)
        receiver._select = self
        self._receivers[receiver._core.serial] = receiver

    def __len__(self):
        return len(self._receivers)

    def get(self, timeout=None):
        """The next Message from any receiver; spindle.TimeoutError after `timeout` seconds."""
        if self._closed:
            raise ChannelError("spindle: the Select is closed")
        item = self._core.get(_timeout_arg(timeout))
        if item is None:
            if self._closed:
                raise ChannelError("spindle: the Select was closed while waiting")
            raise TimeoutError(f"spindle: no message within {timeout} s")
        receiver = self._receivers.get(item[0])
        if receiver is None:  # closed meanwhile: its message still says where it came
            for n in item[6]:
                Fd(n).close()
            raise ChannelError(f"spindle: a message for a receiver closed since (handle {item[1]})")
        return _message(item, receiver)

    def close(self):
        """Closes its receivers and wakes its waiters. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for rx in list(self._receivers.values()):
            rx.close()
        self._core.close()

    def _abandon(self):
        self._closed = True
        self._core.abandon()

