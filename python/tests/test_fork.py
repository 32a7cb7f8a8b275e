"""os.fork() of a process whose Spindle threads are busy, and router.fork()
from a thread while others have calls in flight."""

import faulthandler
import os
import signal
import threading
import time

import spindle
import pyfuncs


def _exit_code_of_child(fn):
    """Runs fn() in an os.fork() child; returns its exit code (0: fn returned True)."""
    pid = os.fork()
    if pid == 0:
        # A hang here prints every thread's Python stack at 100 s, and ends as
        # SIGALRM at 120 s, not as the parent's waitpid forever.
        faulthandler.dump_traceback_later(100)
        signal.alarm(120)
        code = 1
        try:
            code = 0 if fn() else 3
        except BaseException:  # noqa: B902 - reported through the exit code
            import traceback
            traceback.print_exc()
            code = 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)  # -14: the child hung (SIGALRM)


def test_os_fork_while_calls_are_in_flight():
    with spindle.Router() as router:
        child = router.fork()
        stop = threading.Event()
        errors = []

        def hammer():
            try:
                while not stop.is_set():
                    assert child.call(pyfuncs.square, 3) == 9
                    child.call_async(pyfuncs.add, 1, 2)
            except BaseException as exc:  # noqa: B902 - checked below
                errors.append(exc)

        threads = [threading.Thread(target=hammer) for _ in range(3)]
        for t in threads:
            t.start()
        slow = [child.call_async(pyfuncs.slow, 0.05, i) for i in range(5)]

        def in_the_fork_child():
            # The parent's Router is unusable here (its threads are gone);
            # a new one works, with children of its own.
            with spindle.Router() as again:
                c = again.fork()
                s = again.spawn()
                return (c.call(pyfuncs.square, 5) == 25 and s.call(pyfuncs.square, 6) == 36
                        and c.call_async(pyfuncs.add, 2, 2).result(timeout=30) == 4)

        codes = [_exit_code_of_child(in_the_fork_child) for _ in range(3)]
        stop.set()
        for t in threads:
            t.join(timeout=60)
        assert codes == [0, 0, 0]
        assert not errors
        assert [f.result(timeout=30) for f in slow] == list(range(5))
        assert child.call(pyfuncs.square, 4) == 16


def test_inherited_router_is_closed_in_the_fork_child():
    with spindle.Router() as router:
        child = router.fork()

        def in_the_fork_child():
            try:
                child.call(pyfuncs.square, 2)
            except spindle.ShutdownError:
                return True
            return False

        assert _exit_code_of_child(in_the_fork_child) == 0
        assert child.call(pyfuncs.square, 2) == 4


def test_an_inherited_sender_or_port_refuses_to_send_in_the_fork_child():
    """A Sender (or the port under it) copied into an os.fork() child refers
    to the parent's router, whose broker thread is not there: a send must
    raise ShutdownError at once, not queue where nothing writes it, hang,
    or write on the link the parent shares."""
    with spindle.Router() as router:
        rx = router.receiver()
        sender = rx.sender
        port = router._owner._port

        def in_the_fork_child():
            refused = []
            for attempt in (lambda: sender.send("from the fork child"),
                            lambda: port.send(rx.context_id, rx.handle, b"\x01", [], 0),
                            port.receiver, port.batch):
                try:
                    attempt()
                except spindle.ShutdownError as e:
                    refused.append("inherited through a fork" in str(e) and f"pid {os.getpid()}" in str(e))
                else:
                    refused.append(False)
            return refused == [True] * 4

        assert _exit_code_of_child(in_the_fork_child) == 0
        # Nothing reached the parent's receiver, which still works.
        sender.send("from the parent")
        assert rx.get(timeout=30).data == "from the parent"
        try:
            rx.get(timeout=0.2)
        except spindle.TimeoutError:
            pass
        else:
            raise AssertionError("the fork child's send arrived")


def test_router_fork_while_other_threads_call():
    with spindle.Router() as router:
        first = router.fork()
        stop = threading.Event()

        def hammer():
            while not stop.is_set():
                assert first.call(pyfuncs.square, 3) == 9

        threads = [threading.Thread(target=hammer) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            children = [router.fork(name=f"w{i}") for i in range(5)]
            assert [c.call(pyfuncs.square, i) for i, c in enumerate(children)] == [i * i for i in range(5)]
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)


def test_router_fork_from_another_thread():
    with spindle.Router() as router:
        made = []
        t = threading.Thread(target=lambda: made.append(router.fork(name="from-thread")))
        t.start()
        t.join(timeout=60)
        [child] = made
        assert child.call(pyfuncs.square, 8) == 64
        assert child.call(pyfuncs.getpid) == child.pid


def test_children_kept_after_their_router_closed_hold_no_fds():
    """A stopped child's handle keeps its name, pid and status, not its pidfd."""
    before = sorted(os.listdir("/proc/self/fd"), key=int)
    with spindle.Router() as router:
        kids = [router.fork(name=f"kept-{i}") for i in range(3)]
        assert [k.call(os.getpid) for k in kids] == [k.pid for k in kids]
    assert sorted(os.listdir("/proc/self/fd"), key=int) == before
    assert [k.name for k in kids] == ["kept-0", "kept-1", "kept-2"]
    assert all(os.WIFEXITED(k.stop()) for k in kids)


def test_closing_is_prompt_while_an_os_fork_child_holds_the_links():
    """A multiprocessing worker forked beside a Router keeps copies of the
    Router's sockets (its Spindle objects are abandoned, fds and all). Closing
    the Router must still end each link for its child at once: before, in
    about one close in six, a child that had sent its goodbye waited out its
    whole 5 s grace for an EOF that the worker's copy held back."""
    for attempt in range(30):
        router = spindle.Router()
        child = router.fork()
        holder = os.fork()
        if holder == 0:
            signal.alarm(60)
            signal.pause()
            os._exit(0)
        try:
            futures = [child.call_async(pyfuncs.echo, k) for k in range(300)]
            assert [f.result(timeout=30) for f in futures] == list(range(300))
            t = time.monotonic()
            router.close()
            took = time.monotonic() - t
            assert took < 2, f"attempt {attempt}: closing took {took:.1f} s"
        finally:
            os.kill(holder, signal.SIGKILL)
            os.waitpid(holder, 0)
