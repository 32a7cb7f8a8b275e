"""File descriptors in messages: send(..., fds=[...]), spindle.Fd, FdError.

Real fds between real processes: pipes and memfds, a receiver at its
RLIMIT_NOFILE, and /proc/self/fd counted before and after.
"""

import errno
import gc
import os
import resource
import threading

import pytest

import spindle

BOUND = 20  # seconds: a failure bound only


def open_fds():
    return len(os.listdir("/proc/self/fd"))


def is_open(fd):
    try:
        os.fstat(fd)
        return True
    except OSError as e:
        assert e.errno == errno.EBADF
        return False


# --- run in children ---

def fd_main(env):
    """Serves a receiver: ["write", data, sender] writes data to the fd it came
    with; ["read", sender] sends back what the fd (a memfd) holds."""
    rx = env.receiver()
    env.expose("rx_handle", lambda: rx.handle)

    def loop():
        for msg in rx:
            op = msg.data[0]
            try:
                if op == "write":
                    with msg.fds[0] as fd:
                        os.write(fd.fileno(), msg.data[1])
                    msg.data[2].send(["written", len(msg.fds)])
                elif op == "read":
                    fd = msg.fds[0].detach()  # ours now: a plain int
                    try:
                        msg.data[1].send(os.pread(fd, 100, 0))
                    finally:
                        os.close(fd)
            except Exception as e:  # noqa: B902 - reported to the test
                msg.data[-1].send(["error", repr(e)])

    threading.Thread(target=loop, daemon=True).start()
    return env.serve()


_fillers = []
_saved_limit = None


def exhaust_fds():
    """Lowers RLIMIT_NOFILE to a little above what is open, then fills it."""
    global _saved_limit
    _saved_limit = resource.getrlimit(resource.RLIMIT_NOFILE)
    highest = max(int(n) for n in os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 16, _saved_limit[1]))
    while True:
        try:
            _fillers.append(os.dup(0))
        except OSError as e:
            assert e.errno == errno.EMFILE
            return len(_fillers)


def release_fds():
    while _fillers:
        os.close(_fillers.pop())
    resource.setrlimit(resource.RLIMIT_NOFILE, _saved_limit)
    return True


def count_fds():
    return open_fds()


# --- tests ---

@pytest.fixture(params=["fork", "spawn"])
def fd_child(request, router):
    if request.param == "fork":
        c = router.fork(fd_main, name="fd-fork")
    else:
        c = router.spawn(main="test_fds:fd_main", name="fd-spawn")
    yield c
    c.stop()


def test_a_pipe_sent_to_a_child_is_written_there(router, fd_child):
    handle = fd_child.call("rx_handle")
    r, w = os.pipe()
    try:
        with router.receiver() as rx:
            fd_child.send(handle, ["write", b"from the child", rx.sender], fds=[w])
            assert rx.get(timeout=BOUND).data == ["written", 1]
        assert is_open(w)  # a duplicate went: the caller keeps its own
        os.close(w)
        w = -1
        assert os.read(r, 100) == b"from the child"
        assert os.read(r, 100) == b""  # the child closed its copy: no other writer is left
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def test_a_memfd_and_an_object_with_fileno(router, fd_child):
    handle = fd_child.call("rx_handle")
    m = os.memfd_create("spindle-test", os.MFD_CLOEXEC)
    with os.fdopen(m, "wb+") as f:  # fileno() is what send() takes from it
        f.write(b"in a memfd")
        f.flush()
        with router.receiver() as rx:
            fd_child.send(handle, ["read", rx.sender], fds=[f])
            assert rx.get(timeout=BOUND).data == b"in a memfd"


def test_received_fds_close_exactly_once(router):
    me = router.context(router.id)
    r, w = os.pipe()
    try:
        with router.receiver() as rx:
            me.send(rx.handle, "three", fds=[r, r, w])
            msg = rx.get(timeout=BOUND)
            a, b, c = msg.fds
            assert all(isinstance(f, spindle.Fd) for f in msg.fds)
            numbers = [f.fileno() for f in msg.fds]
            assert len(set(numbers + [r, w])) == 5 and all(map(is_open, numbers))
            # close(): closed, and only once
            a.close()
            assert a.closed and not is_open(numbers[0])
            a.close()
            with pytest.raises(ValueError):
                a.fileno()
            # detach(): the caller's; the Fd no longer closes it
            n = b.detach()
            assert n == numbers[1] and b.closed
            b.close()
            del b, msg
            gc.collect()
            assert is_open(n)
            os.close(n)
            # with: closed at the end
            with c as fd:
                os.write(fd.fileno(), b"x")
            assert c.closed and not is_open(numbers[2])
            assert os.read(r, 1) == b"x"
            # garbage collection closes one nobody closed
            me.send(rx.handle, "one", fds=[w])
            msg = rx.get(timeout=BOUND)
            lost = msg.fds[0].fileno()
            del msg
            gc.collect()
            assert not is_open(lost)
    finally:
        os.close(r)
        os.close(w)


def test_bad_fds_are_refused_before_sending(router):
    me = router.context(router.id)
    r, w = os.pipe()
    os.close(w)
    with router.receiver() as rx:
        with pytest.raises(ValueError, match=f"fd {w}"):
            me.send(rx.handle, 1, fds=[r, w])  # w is closed
        with pytest.raises(ValueError):
            me.send(rx.handle, 1, fds=[-1])
        with pytest.raises(TypeError):
            me.send(rx.handle, 1, fds=[1.5])
        with pytest.raises(TypeError):
            me.send(rx.handle, 1, fds=[True])
        with pytest.raises(ValueError, match="253"):
            me.send(rx.handle, 1, fds=[r] * 254)
        with pytest.raises(spindle.TimeoutError):
            rx.get(timeout=0)
        me.send(rx.handle, "max", fds=[r] * 253)  # the limit itself goes
        msg = rx.get(timeout=BOUND)
        assert len(msg.fds) == 253
        for f in msg.fds:
            f.close()
    os.close(r)


def test_a_receiver_out_of_fds_is_an_fd_error_for_the_sender(router):
    child = router.fork(fd_main, name="starved")
    handle = child.call("rx_handle")
    assert child.call(exhaust_fds) > 0
    r, w = os.pipe()
    try:
        with router.receiver() as replies:
            child.send(handle, ["write", b"lost", replies.sender], fds=[w], reply_to=replies)
            with pytest.raises(spindle.FdError, match="receiver out of file descriptors") as info:
                replies.get(timeout=BOUND)
            assert isinstance(info.value, spindle.ChannelError)
            assert "MSG_CTRUNC" in str(info.value)
            # The link survives: once the child has fds again, the same send works.
            assert child.call(release_fds) is True
            child.send(handle, ["write", b"kept", replies.sender], fds=[w], reply_to=replies)
            assert replies.get(timeout=BOUND).data == ["written", 1]
        os.close(w)
        w = -1
        assert os.read(r, 100) == b"kept"  # never "lost": that message was not delivered
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
        child.stop()


def send_an_fd_while_out_of_fds(sender):
    """In a child: with every fd of its limit in use, a send with an fd
    cannot duplicate it. Returns what it raised (and sends nothing)."""
    r, w = os.pipe()
    try:
        exhaust_fds()
        try:
            sender.send(b"never", fds=[w])
        except spindle.FdError as e:
            return ["FdError", str(e), isinstance(e, spindle.ChannelError)]
        except Exception as e:  # noqa: B902 - reported to the test
            return ["other", repr(e), False]
        finally:
            release_fds()
        return ["sent", "", False]
    finally:
        os.close(r)
        os.close(w)


def test_a_sender_out_of_fds_gets_an_fd_error_and_sends_nothing(router):
    child = router.fork(name="sender-starved")
    try:
        with router.receiver() as rx:
            kind, text, is_channel_error = child.with_timeout(BOUND).call(send_an_fd_while_out_of_fds, rx.sender)
            assert kind == "FdError", text
            assert "cannot duplicate the fds to send" in text and "Too many open files" in text
            assert is_channel_error
            # Nothing was sent: it would have come on the link before the
            # call's answer, so the next message is a marker sent now.
            router.context(router.id).send(rx.handle, "marker")
            assert rx.get(timeout=BOUND).data == "marker"
    finally:
        child.stop()


def test_fds_never_leak(router):
    child = router.fork(fd_main, name="counted")
    handle = child.call("rx_handle")
    me = router.context(router.id)
    r, w = os.pipe()
    with router.receiver() as rx:
        # Warm up (the first message may open what stays open: a memfd pool...)
        me.send(rx.handle, 0, fds=[r])
        rx.get(timeout=BOUND).fds[0].close()
        child.send(handle, ["write", b".", rx.sender], fds=[w])
        rx.get(timeout=BOUND)
        os.read(r, 1)
        gc.collect()  # what earlier tests left for the collector is not counted
        before, child_before = open_fds(), child.call(count_fds)
        for i in range(50):
            me.send(rx.handle, i, fds=[r, w])
            msg = rx.get(timeout=BOUND)
            if i % 2:
                for f in msg.fds:
                    f.close()
            # else: dropped, closed by garbage collection
            child.send(handle, ["write", b".", rx.sender], fds=[w])
            assert rx.get(timeout=BOUND).data == ["written", 1]
        del msg
        gc.collect()
        assert os.read(r, 100) == b"." * 50
        assert open_fds() == before
        assert child.call(count_fds) == child_before
    os.close(r)
    os.close(w)
    child.stop()


def test_a_dead_message_whose_text_is_not_utf8_closes_its_fds(router):
    # A peer can send any bytes as a dead message (reply_to 999) with fds:
    # decoding its text raised before the fds had owners, and they leaked.
    me = router.context(router.id)
    r, w = os.pipe()
    with router.receiver() as rx:
        me.send(rx.handle, 0, fds=[r])  # warm up, as above
        rx.get(timeout=BOUND).fds[0].close()
        gc.collect()
        before = open_fds()
        for _ in range(20):
            me.send(rx.handle, b"\xff\xfe", fds=[r, w] * 4, reply_to=999)
            with pytest.raises(spindle.ChannelError):
                rx.get(timeout=BOUND)
        gc.collect()
        assert open_fds() == before
    os.close(r)
    os.close(w)
