"""Calls from a Python parent to its Python children (forked and spawned)."""

import asyncio
import os
import pickle
import select
import signal
import threading
import time

import pytest

import spindle
import pyfuncs


def test_module_function_runs_in_the_child(child):
    assert child.call(pyfuncs.square, 7) == 49
    assert child.call(pyfuncs.getpid) == child.pid != os.getpid()


@pytest.mark.parametrize("spin", [0, 1e-3])
def test_wait_spin_zero_or_more_serves_calls_both_ways(spin):
    # The window only decides whether a waiting thread polls before it
    # sleeps; calls and the child's serving thread work the same either way.
    with spindle.Router(wait_spin=spin) as router:
        child = router.fork()
        assert [child.call(pyfuncs.square, n) for n in range(50)] == [n * n for n in range(50)]
        assert child.call_async(pyfuncs.square, 9).result(timeout=10) == 81


@pytest.mark.parametrize("bad", [-1e-6, 2.0, float("nan")])
def test_wait_spin_out_of_range_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="wait_spin is 0 to 1 seconds"):
        spindle.Router(wait_spin=bad)


def test_keyword_arguments(child):
    assert child.call(pyfuncs.add, 1, 2, c=3) == 6
    assert child.call(pyfuncs.add, 1, b=10) == 11


def test_msgpack_values_round_trip(child):
    value = {"none": None, "t": True, "i": -5, "big": 2**63 + 1, "f": 1.5,
             "s": "é", "b": b"\x00\xff", "l": [1, [2, 3]], "d": {"k": "v"}}
    assert child.call(pyfuncs.echo, value) == value
    assert child.call(pyfuncs.echo, (1, 2)) == [1, 2]  # msgpack has no tuples


def test_a_map_with_other_keys_is_refused_and_a_dict_with_them_goes_pickled(child):
    from spindle import _spindle
    # A tuple's hash is a fixed function of its items: a peer could send
    # thousands of colliding keys. A received map takes scalar keys only.
    with pytest.raises(ValueError, match="map key of msgpack type array"):
        _spindle.unpack(b"\x81\x92\x01\x02\xc0", None)  # {[1, 2]: nil}
    with pytest.raises(ValueError, match="map key of msgpack type map"):
        _spindle.unpack(b"\x81\x80\xc0", None)  # {{}: nil}
    scalars = {None: 0, True: 1, 7: 2, -8: 3, 1.5: 4, "s": 5, b"b": 6}
    assert _spindle.unpack(_spindle.pack(scalars, None), None) == scalars
    # Such a dict still travels within the family: pickled whole.
    keyed = {(1, 2): "a", "x": {(3,): "b"}}
    assert child.call(pyfuncs.echo, keyed) == keyed
    with pytest.raises(TypeError, match="a dict with a key of type tuple cannot travel as msgpack"):
        _spindle.pack({(1, 2): "a"}, None)  # no pickler: a router connection


def test_a_childs_pickles_are_trusted_while_the_child_is_owned(router):
    trusted = router._owner._trust.ids
    child = router.fork()
    cid = child.id
    assert cid in trusted
    child.stop()
    assert cid not in trusted
    other = router.fork()
    oid = other.id
    assert oid in trusted
    del other
    import gc
    gc.collect()
    assert oid not in trusted and router.id in trusted


def test_a_dead_childs_pickles_are_refused_while_its_child_object_lives(router):
    """Trust is bound to the link the child was started on: once it is gone,
    nothing that later arrives with its id is unpickled (after the id space
    wraps round, another context could be given that id)."""
    trust = router._owner._trust
    child = router.fork()
    cid = child.id
    assert trust.unpickler(cid) is pickle.loads
    os.kill(child.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while trust.unpickler(cid) is pickle.loads and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cid in trust.ids  # the Child still owns its (dead) process...
    with pytest.raises(spindle.PickleRefusedError):
        trust.unpickler(cid)(b"")  # ...but its id no longer passes
    child.stop()


def test_pickle_between_parent_and_child(child):
    p = child.call(pyfuncs.make_point, 2, 3)
    assert isinstance(p, pyfuncs.Point) and p == pyfuncs.Point(2, 3)
    assert child.call(pyfuncs.point_sum, pyfuncs.Point(4, 5)) == 9
    assert child.call(pyfuncs.echo, {1, 2}) == {1, 2}
    assert child.call(pyfuncs.echo, 2**70) == 2**70


def test_exposed_python_function_by_name(router):
    # A forked child has the parent's @spindle.expose registry; a spawned one
    # imports the module that registers them.
    forked = router.fork()
    assert forked.call("py_square", 9) == 81
    assert forked.call("greet", "ann") == "hello ann"
    spawned = router.spawn(main="pyfuncs:custom_main")
    assert spawned.call("custom.triple", 5) == 15
    with pytest.raises(TypeError, match="positional"):
        forked.call("greet", name="x")


def test_fork_with_a_target(router):
    c = router.fork(pyfuncs.custom_main)
    assert c.call("custom.triple", 4) == 12
    assert c.call(pyfuncs.square, 3) == 9  # serve() still takes module functions


def test_remote_exception_is_a_call_error(child):
    with pytest.raises(spindle.CallError) as info:
        child.call(pyfuncs.boom, "no luck")
    e = info.value
    assert e.remote_type == "ValueError"
    assert e.message == "no luck"
    assert "in boom" in e.traceback and "raise ValueError(text)" in e.traceback
    with pytest.raises(spindle.CallError) as info:
        child.call("py_fail", "k") if child.name == "py-fork" else child.call(pyfuncs.py_fail, "k")
    assert info.value.remote_type == "KeyError"


def test_unknown_function(child):
    with pytest.raises(spindle.ChannelError, match="unknown (method: fn.nope|service: fn)"):
        child.call("nope")
    with pytest.raises(spindle.CallError) as info:
        child.call(pyfuncs.Point.__init__, 1)  # not reachable as a call: wrong arguments
    assert info.value.remote_type == "TypeError"


def test_local_functions_are_refused():
    def inner():
        pass
    with spindle.Router() as r:
        c = r.fork()
        with pytest.raises(TypeError, match="module-level"):
            c.call(inner)
        with pytest.raises(TypeError, match="module-level"):
            c.call(lambda: 1)


def test_call_async_returns_a_future(child):
    futures = [child.call_async(pyfuncs.square, i) for i in range(200)]
    assert [f.result(timeout=30) for f in futures] == [i * i for i in range(200)]
    bad = child.call_async(pyfuncs.boom, "async")
    with pytest.raises(spindle.CallError, match="async"):
        bad.result(timeout=30)


def test_acall_for_asyncio(child):
    async def main():
        return await asyncio.gather(*(child.acall(pyfuncs.add, i, c=1) for i in range(20)))
    assert asyncio.run(main()) == [i + 1 for i in range(20)]


def test_timeout(child):
    with pytest.raises(spindle.TimeoutError):
        child.with_timeout(0.2).call(pyfuncs.slow, 2, "late")


def test_calls_from_many_threads(child):
    results = {}

    def worker(k):
        results[k] = [child.call(pyfuncs.add, k, i) for i in range(50)]

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {k: [k + i for i in range(50)] for k in range(4)}


def test_killed_child_fails_pending_calls_at_once(child, tmp_path):
    fifo = tmp_path / "started"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # the child's open for writing succeeds
    try:
        pending = child.call_async(pyfuncs.block_forever, str(fifo))
        ready, _, _ = select.select([reader], [], [], 30)
        assert ready and os.read(reader, 1) == b"!", "the child never started the call"
    finally:
        os.close(reader)
    queued = child.call_async(pyfuncs.square, 2)  # waits behind the blocked call
    os.kill(child.pid, signal.SIGKILL)
    for future in (pending, queued):
        with pytest.raises(spindle.ChannelError) as info:
            future.result(timeout=10)  # at once: well before the 30 s call timeout
        assert "peer disconnected" in str(info.value)  # the reason the router gave
    with pytest.raises(spindle.ChannelError):
        child.call(pyfuncs.square, 2)
    assert os.WTERMSIG(child.stop()) == signal.SIGKILL


def test_closed_router_raises_shutdown_error():
    r = spindle.Router()
    c = r.fork()
    r.close()
    with pytest.raises(spindle.ShutdownError):
        c.call(pyfuncs.square, 2)


def test_futures_complete_on_a_python_thread_not_the_broker(child):
    seen = []
    done = threading.Event()
    f = child.call_async(pyfuncs.square, 5)
    f.add_done_callback(lambda _: (seen.append(threading.current_thread().name), done.set()))
    assert f.result(timeout=30) == 25
    assert done.wait(30)
    # The callback ran on the Router's completion thread (or here, if the
    # future was already done when the callback was added).
    assert seen[0] in ("spindle-completions", threading.current_thread().name)


def test_gil_is_released_while_a_call_waits(router, tmp_path):
    # One thread waits on a child that never answers; if it held the GIL,
    # this thread could not make a call of its own meanwhile.
    stuck, free = router.fork(name="stuck"), router.fork(name="free")
    fifo = tmp_path / "started"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    outcome = []
    waiter = threading.Thread(
        target=lambda: outcome.append(pytest.raises(spindle.ChannelError, stuck.call,
                                                    pyfuncs.block_forever, str(fifo))))
    waiter.start()
    try:
        assert select.select([reader], [], [], 30)[0], "the stuck child never started the call"
    finally:
        os.close(reader)
    assert waiter.is_alive()  # blocked in its call...
    assert [free.call(pyfuncs.square, i) for i in range(20)] == [i * i for i in range(20)]
    os.kill(stuck.pid, signal.SIGKILL)  # ...until its callee dies
    waiter.join(timeout=30)
    assert not waiter.is_alive() and outcome


def test_child_main_exit_status(router):
    c = router.fork(pyfuncs.exit_main)
    assert os.waitstatus_to_exitcode(c.stop()) == 7
    s = router.spawn(main="pyfuncs:exit_main")
    assert os.waitstatus_to_exitcode(s.stop()) == 7


def test_an_infinite_timeout_means_wait(router, child):
    # float('inf') overflowed the conversion to milliseconds (undefined
    # behaviour: the call timed out at once).
    assert child.with_timeout(float("inf")).call(pyfuncs.square, 7) == 49
    assert child.with_timeout(float("inf")).call_async(pyfuncs.square, 8).result(timeout=30) == 64
    with router.receiver() as rx:
        router.context(router.id).send(rx.handle, "here")
        assert rx.get(timeout=float("inf")).data == "here"
