"""kill -9 of either side mid-transfer leaves nothing behind.

Large payloads travel in memfds, which have no name in /dev/shm and go
away with the last fd or mapping: unlike multiprocessing.shared_memory, a
killed process cannot leak one. These tests kill a child and a parent in
the middle of 64 MiB transfers and check /dev/shm, the parent's fds and
the processes themselves.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy
import pytest

import spindle
import pyfuncs

MIB = 1 << 20


def shm_entries():
    return sorted(os.listdir("/dev/shm"))


def fd_count():
    return len(os.listdir("/proc/self/fd"))


def exited(pid):
    """Whether `pid` has exited: gone, or a zombie that nobody reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except FileNotFoundError:
        return True


def wait_until(predicate, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_a_child_killed_mid_transfer_leaves_nothing(router):
    before_shm, before_fds = shm_entries(), fd_count()
    child = router.fork(name="victim")
    big = numpy.ones(64 * MIB, dtype=numpy.uint8)
    futures = [child.with_timeout(60).call_async(pyfuncs.describe_buffer, big) for _ in range(4)]
    futures.append(child.with_timeout(60).call_async(pyfuncs.make_array, 64 * MIB))
    os.kill(child.pid, signal.SIGKILL)
    for f in futures:
        try:
            f.result(timeout=30)  # some may have finished before the kill
        except spindle.ChannelError as e:
            # Killed, or refused before: the child's lane holds 64 MiB of
            # calls at most, and a slow child may not have taken the first.
            assert any(k in str(e) for k in ("victim", "disconnected", "service queue full")), e
    assert os.WTERMSIG(child.stop()) == signal.SIGKILL
    # A result that arrived maps a memfd: let it go before counting fds.
    # The Child stays: once reaped it holds no fd (its pidfd closed with
    # the reap), though it still knows its pid and status.
    del futures, f
    assert os.WTERMSIG(child.stop()) == signal.SIGKILL and child.pid > 0
    assert shm_entries() == before_shm
    assert wait_until(lambda: fd_count() <= before_fds, 10), (fd_count(), before_fds)


PARENT = textwrap.dedent("""
    import sys, numpy, spindle, pyfuncs
    router = spindle.Router()
    child = router.fork(name="orphan")
    print(child.pid, flush=True)
    big = numpy.ones(64 << 20, dtype=numpy.uint8)
    futures = [child.with_timeout(60).call_async(pyfuncs.describe_buffer, big) for _ in range(8)]
    print("sending", flush=True)
    sys.stdin.read()  # killed here
""")


def test_a_parent_killed_mid_transfer_leaves_nothing():
    before_shm = shm_entries()
    env = dict(os.environ)
    proc = subprocess.Popen([sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        child_pid = int(proc.stdout.readline())
        assert proc.stdout.readline().strip() == "sending"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        # The child loses its parent (EOF on its link) and exits by itself.
        assert wait_until(lambda: exited(child_pid), 30), "the orphaned child is still running"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert shm_entries() == before_shm


def test_a_killed_child_whose_fork_holds_its_link_fails_its_calls_at_once(router):
    """A worker that forked (multiprocessing, a daemon) is killed: its fork
    still holds the worker's end of the link, so no EOF comes. The parent
    learns of the death from the worker's pidfd and fails what waited on it
    at once, naming the signal; before, the call waited for its timeout."""
    child = router.fork(name="forker")
    holder = child.call(pyfuncs.fork_holder)
    try:
        pending = child.with_timeout(60).call_async(pyfuncs.slow, 30, "late")
        t = time.monotonic()
        os.kill(child.pid, signal.SIGKILL)
        with pytest.raises(spindle.ChannelError, match="killed by signal 9"):
            pending.result(timeout=10)
        assert time.monotonic() - t < 5
        assert os.WTERMSIG(child.stop()) == signal.SIGKILL
    finally:
        os.kill(holder, signal.SIGKILL)


HOLDING_PARENT = textwrap.dedent("""
    import os, signal, sys, spindle, pyfuncs
    router = spindle.Router()
    child = router.fork(name="orphan")
    assert child.call(pyfuncs.square, 3) == 9
    holder = os.fork()  # a multiprocessing worker would: it holds the child's link too
    if holder == 0:
        signal.alarm(60)
        while True:
            signal.pause()
    print(child.pid, holder, flush=True)
    sys.stdin.read()  # killed here
""")


def test_a_child_ends_when_its_parent_is_killed_while_a_fork_of_the_parent_holds_its_link():
    """No EOF comes (the parent's fork holds its end of the link): the child
    learns of its parent's death from the parent's pidfd."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDING_PARENT], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    child_pid = holder = 0
    try:
        child_pid, holder = map(int, proc.stdout.readline().split())
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert wait_until(lambda: exited(child_pid), 10), "the orphaned child is still running"
    finally:
        for pid in (child_pid, holder):
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if proc.poll() is None:
            proc.kill()
        proc.wait()
