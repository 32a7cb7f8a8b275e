"""Clients of a spindle-router: spindle.connect(), and pickle refused there."""

import os
import select
import subprocess
import threading

import pytest

import spindle
import pyfuncs  # registers @spindle.expose functions, which a Connection must not serve


@pytest.fixture
def router_socket(tmp_path):
    """A real spindle-router on a socket in tmp_path, ready to connect to."""
    sock = str(tmp_path / "router.sock")
    program = os.path.join(os.environ["SPINDLE_TOOLS_DIR"], "spindle-router")
    proc = subprocess.Popen([program, "--socket", sock, "--log-level", "info"],
                            stderr=subprocess.PIPE)
    try:
        # Its log says "ready" once it listens. Read the pipe's fd directly:
        # a buffered reader could hold that line while select() waits.
        fd = proc.stderr.fileno()
        seen = b""
        while b" ready: " not in seen:
            assert select.select([fd], [], [], 20)[0], f"spindle-router did not start: {seen!r}"
            chunk = os.read(fd, 4096)
            assert chunk, f"spindle-router exited: {seen!r}"
            seen += chunk
        yield sock
    finally:
        proc.terminate()
        proc.wait(timeout=20)


class Worker:
    """A named client serving on a thread of its own."""

    def __init__(self, sock, name, allow_pickle=False):
        self.conn = spindle.connect(sock, name=name, allow_pickle=allow_pickle)
        self.conn.expose("upper", str.upper, anyone=True)
        self.conn.expose("echo", lambda v: v, anyone=True)
        self.conn.expose("make_set", lambda: {1, 2}, anyone=True)
        self.conn.ready()
        self.thread = threading.Thread(target=self.conn.serve)
        self.thread.start()

    def close(self):
        self.conn.close()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()


def test_clients_call_each_other(router_socket):
    worker = Worker(router_socket, "upper-1")
    try:
        with spindle.connect(router_socket) as me:
            [w] = me.find("upper-*")
            assert w.name == "upper-1"
            assert w.call("upper", "hi") == "HI"
            assert w.call_async("echo", [1, {"a": b"x"}]).result(timeout=30) == [1, {"a": b"x"}]
    finally:
        worker.close()


def test_pickle_is_refused_over_a_router_connection(router_socket):
    worker = Worker(router_socket, "strict")
    try:
        with spindle.connect(router_socket) as me:
            [w] = me.find("strict")
            # The worker refuses to unpickle an argument...
            with pytest.raises(spindle.CallError) as info:
                w.call("echo", {1, 2})  # a set: not msgpack, so pickled
            assert info.value.remote_type == "spindle.PickleRefusedError"
            assert "allow_pickle=True" in info.value.message
            # ...and the caller refuses to unpickle a result.
            with pytest.raises(spindle.PickleRefusedError, match="allow_pickle=True"):
                w.call("make_set")
            assert w.call("echo", [1, 2]) == [1, 2]  # msgpack still flows
    finally:
        worker.close()


def test_pickle_over_a_router_when_both_opt_in(router_socket):
    worker = Worker(router_socket, "trusting", allow_pickle=True)
    try:
        with spindle.connect(router_socket, allow_pickle=True) as me:
            [w] = me.find("trusting")
            assert w.call("echo", {1, 2}) == {1, 2}
            assert w.call("make_set") == {1, 2}
    finally:
        worker.close()


def test_connect_to_nothing_is_a_clear_error(tmp_path):
    with pytest.raises(spindle.Error, match="nobody.sock"):
        spindle.connect(str(tmp_path / "nobody.sock"), timeout=5)


def test_a_connection_serves_only_what_it_exposed(router_socket):
    # Module functions (py.call) would let any client run any importable
    # function here; @spindle.expose functions are for children.
    worker = Worker(router_socket, "narrow")
    try:
        with spindle.connect(router_socket) as me:
            [w] = me.find("narrow")
            with pytest.raises(spindle.ChannelError, match="unknown service: py"):
                w.call(pyfuncs.square, 2)
            with pytest.raises(spindle.ChannelError, match="unknown method: fn.py_square"):
                w.call("py_square", 2)
    finally:
        worker.close()


def test_a_closed_connection_refuses_ready_and_serve(router_socket):
    # Both used the env that close() had freed.
    c = spindle.connect(router_socket)
    c.expose("upper", str.upper, anyone=True)
    c.close()
    with pytest.raises(spindle.ShutdownError):
        c.ready()
    with pytest.raises(spindle.ShutdownError):
        c.serve()


def test_close_races_serve_on_another_thread(router_socket):
    # close() frees the env only once a serve() that got in has left it; one
    # that comes after is refused. Either way the thread ends, and nothing
    # reads freed memory (ASan-visible before, a crash at worst).
    for _ in range(10):
        c = spindle.connect(router_socket)
        c.expose("upper", str.upper, anyone=True)
        c.ready()
        refused = []

        def serve():
            try:
                c.serve()
            except (spindle.ShutdownError, ValueError) as e:
                refused.append(e)

        t = threading.Thread(target=serve)
        t.start()
        c.close()
        t.join(30)
        assert not t.is_alive()
        assert all("closed" in str(e) for e in refused)
