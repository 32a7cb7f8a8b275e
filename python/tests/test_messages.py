"""ctx.send(), receivers, Senders and spindle.Select, between real processes.

Timeouts here are failure bounds only: every wait ends with a message that
the test caused, never with time passing (except the timeout tests).
"""

import os
import pickle
import signal
import sys
import threading
import time

import pytest

import spindle
from test_router import router_socket  # noqa: F401 - a fixture

BOUND = 20  # seconds: a failure bound, never a wait that "should be enough"


# --- run in children (module-level: the children import them by name) ---

def send_each(sender, values):
    for v in values:
        sender.send(v)
    return len(values)


def echo_main(env):
    """A child that answers [sender, n] sent to its receiver with n * 2, on that sender."""
    rx = env.receiver()
    env.expose("rx_handle", lambda: rx.handle)

    def loop():
        for msg in rx:
            back, n = msg.data
            back.send(n * 2)

    threading.Thread(target=loop, daemon=True).start()
    return env.serve()


def keeping_main(env):
    """A child whose receiver keeps what arrives, or why it was refused."""
    rx = env.receiver()
    kept = []
    arrived = threading.Condition()

    def loop():
        while True:
            try:
                item = ("value", repr(rx.get().data))
            except spindle.PickleRefusedError as e:
                item = ("refused", str(e))
            except spindle.ChannelError:
                return
            with arrived:
                kept.append(item)
                arrived.notify_all()

    def first(n):
        with arrived:
            arrived.wait_for(lambda: len(kept) >= n, timeout=BOUND)
            return kept[:n]

    env.expose("inbox", lambda: rx.sender)
    env.expose("first", first)
    threading.Thread(target=loop, daemon=True).start()
    return env.serve()


def counting_main(env):
    """A child that counts what its receiver takes."""
    rx = env.receiver()
    got = [0]

    def loop():
        for _ in rx:
            got[0] += 1

    env.expose("rx_handle", lambda: rx.handle)
    env.expose("count", lambda: got[0])
    threading.Thread(target=loop, daemon=True).start()
    return env.serve()


def sender_back(sender):
    """Returns the Sender it was given: it travels back as a result."""
    return sender


# --- tests ---

def test_send_to_a_childs_receiver_and_back(router):
    child = router.fork(echo_main)
    handle = child.call("rx_handle")
    with router.receiver() as rx:
        for n in (1, 21, 1000):
            child.send(handle, [rx.sender, n])
            msg = rx.get(timeout=BOUND)
            assert msg.data == n * 2
            assert msg.src_id == child.id
            assert msg.handle == rx.handle
            assert msg.receiver is rx
            assert msg.fds == []


def test_a_batch_hands_its_sends_over_in_order_when_it_ends(router):
    child = router.fork(echo_main)
    handle = child.call("rx_handle")
    with router.receiver() as rx:
        with router.batch():
            for n in range(200):
                child.send(handle, [rx.sender, n])
            with router.batch():  # batches nest
                child.send(handle, [rx.sender, 200])
            assert child.call("rx_handle") == handle  # a call inside one goes at once
        assert [rx.get(timeout=BOUND).data for _ in range(201)] == [2 * n for n in range(201)]
        batch = router.batch()
        with batch:
            with pytest.raises(ValueError, match="already open"):
                batch.__enter__()


def test_a_sender_passed_as_an_argument(router, child):
    with router.receiver() as rx:
        values = [0, "two", [3, 4], {"five": 5.0}, None, b"six", {7, 8}]  # a set is pickled
        assert child.call(send_each, rx.sender, values) == len(values)
        assert [rx.get(timeout=BOUND).data for _ in values] == values
        assert rx.context_id == router.id


def test_a_sender_naming_a_control_or_reply_handle_is_refused(router, child):
    # The child would send to it in its own name: SHUTDOWN (106) to itself,
    # CALL_SERVICE (110), or a call's reply handle.
    for handle in (106, 110, 0x80000001):
        forged = spindle.Sender(child.id, handle, None)
        with pytest.raises(spindle.CallError, match="no receiver holds"):
            child.call(send_each, forged, [1])
    assert child.call(send_each, router.receiver().sender, []) == 0  # still serving


def test_a_sender_comes_back_as_a_result_and_still_sends(router, child):
    with router.receiver() as rx:
        s = child.call(sender_back, rx.sender)
        assert isinstance(s, spindle.Sender)
        assert s == rx.sender
        s.send("through the returned sender")
        assert rx.get(timeout=BOUND).data == "through the returned sender"


class Envelope:
    """Not msgpack: travels pickled, with the Sender inside the pickle."""

    def __init__(self, sender, text):
        self.sender, self.text = sender, text


def envelope_back(envelope):
    """Sends through the Sender it found inside a pickle, then returns one."""
    envelope.sender.send(envelope.text)
    return Envelope(envelope.sender, envelope.text + " and back")


def test_a_sender_inside_a_pickle_is_bound_to_the_router_that_decodes_it(router, child):
    with router.receiver() as rx:
        back = child.call(envelope_back, Envelope(rx.sender, "from the child"))
        assert rx.get(timeout=BOUND).data == "from the child"  # the child's port sent it
        assert isinstance(back, Envelope) and back.sender == rx.sender
        back.sender.send(back.text)  # and this process's port
        assert rx.get(timeout=BOUND).data == "from the child and back"
    assert spindle._spindle._decoding_port() is None  # nothing left set on this thread


def test_iteration_ends_when_the_receiver_closes(router):
    rx = router.receiver()
    me = router.context(router.id)
    for i in range(3):
        me.send(rx.handle, i)
    got = []
    for msg in rx:
        got.append(msg.data)
        if len(got) == 3:
            rx.close()
    assert got == [0, 1, 2]


def test_select_over_two_receivers_fed_by_two_children(router):
    a, b = router.fork(name="a"), router.fork(name="b")
    rx_a, rx_b = router.receiver(), router.receiver()
    n = 200
    # Both floods are queued before the Select takes anything: fairness
    # then shows in the order the Select hands them out.
    fa = a.call_async(send_each, rx_a.sender, [("a", i) for i in range(n)])
    fb = b.call_async(send_each, rx_b.sender, [("b", i) for i in range(n)])
    assert fa.result(BOUND) == n and fb.result(BOUND) == n
    with spindle.Select([rx_a, rx_b]) as sel:
        assert len(sel) == 2
        got = [sel.get(timeout=BOUND) for _ in range(2 * n)]
        for msg in got:
            assert msg.receiver is (rx_a if msg.data[0] == "a" else rx_b)
            assert msg.src_id == (a.id if msg.data[0] == "a" else b.id)
        # Each receiver's messages in order, all of them.
        assert [m.data[1] for m in got if m.data[0] == "a"] == list(range(n))
        assert [m.data[1] for m in got if m.data[0] == "b"] == list(range(n))
        # Fairness: the first 20 are not all from one receiver.
        assert {m.data[0] for m in got[:20]} == {"a", "b"}
        with pytest.raises(spindle.TimeoutError):
            sel.get(timeout=0.05)
    assert rx_a.closed and rx_b.closed


def test_select_keeps_what_a_receiver_had_queued(router):
    rx = router.receiver()
    me = router.context(router.id)
    for i in range(5):
        me.send(rx.handle, i)
    # The messages are queued by the broker thread: wait for the first one
    # through the receiver itself, then move it with the rest queued.
    first = rx.get(timeout=BOUND)
    with spindle.Select() as sel:
        sel.add(rx)
        rest = [sel.get(timeout=BOUND).data for _ in range(4)]
        assert [first.data] + rest == [0, 1, 2, 3, 4]
        with pytest.raises(ValueError, match="belongs to a Select"):
            rx.get(timeout=0)
        with pytest.raises(ValueError, match="another Select"):
            spindle.Select([rx])


def test_what_a_moved_receiver_keeps_beside_the_select_stays_bounded(router):
    # What a receiver had queued moves with it and is served first, in
    # order; what arrives meanwhile waits in the Select's lanes, which are
    # bounded, and joins the moved ones one at a time. Before, each turn of
    # the Select took all of it out of the lanes, so a flooded receiver's
    # messages piled up beside the Select without bound.
    rx = router.receiver()
    me = router.context(router.id)
    for i in range(10):
        me.send(rx.handle, i)
    first = rx.get(timeout=BOUND)  # the other 9 are queued behind it
    with spindle.Select() as sel:
        sel.add(rx)
        for i in range(10, 1010):
            me.send(rx.handle, i)
        got, most = [first.data], 0
        for _ in range(1009):
            got.append(sel.get(timeout=BOUND).data)
            most = max(most, sel._core._pending())
        assert got == list(range(1010))
        assert most <= 10


def test_a_thread_waiting_in_get_gets_a_message_sent_later(router, child):
    with router.receiver() as rx:
        result = []
        t = threading.Thread(target=lambda: result.append(rx.get(timeout=BOUND).data))
        t.start()  # waits with the GIL released: the call below runs meanwhile
        child.call(send_each, rx.sender, ["late"])
        t.join(BOUND)
        assert result == ["late"]


def test_timeouts(router):
    with router.receiver() as rx, spindle.Select([router.receiver()]) as sel:
        with pytest.raises(spindle.TimeoutError):
            rx.get(timeout=0.05)
        with pytest.raises(spindle.TimeoutError):
            rx.get(timeout=0)
        with pytest.raises(spindle.TimeoutError):
            sel.get(timeout=0.05)
        assert isinstance(spindle.TimeoutError("x"), TimeoutError)  # the builtin too
        with pytest.raises(ValueError):
            rx.get(timeout=-1)


def test_a_closed_receiver(router):
    rx = router.receiver()
    handle = rx.handle
    rx.close()
    rx.close()  # idempotent
    assert rx.closed
    with pytest.raises(spindle.ChannelError, match="closed"):
        rx.get(timeout=1)
    # A message to it gets the library's dead reply, which reaches reply_to.
    with router.receiver() as replies:
        router.context(router.id).send(handle, "anyone?", reply_to=replies)
        with pytest.raises(spindle.ChannelError, match="invalid handle"):
            replies.get(timeout=BOUND)


def waiting_in_get(rx):
    """A started thread waiting in rx.get(), and the list its ChannelError goes to."""
    errors = []

    def wait():
        try:
            rx.get(timeout=BOUND)
        except spindle.ChannelError as e:
            errors.append(e)

    t = threading.Thread(target=wait)
    t.start()
    return t, errors


def test_close_wakes_a_waiting_thread(router):
    rx = router.receiver()
    t, errors = waiting_in_get(rx)
    # Closing before the thread waits is the same for it: get() then sees a
    # closed receiver at once.
    rx.close()
    t.join(BOUND)
    assert not t.is_alive() and len(errors) == 1


def test_a_receiver_moved_into_a_select_while_a_thread_waits_on_it(router):
    # The waiting thread held the receiver's own core only through the
    # receiver, which Select() let go: it read freed memory (a crash).
    for _ in range(5):
        rx = router.receiver()
        t, errors = waiting_in_get(rx)
        while sys._current_frames().get(t.ident) is None or \
                sys._current_frames()[t.ident].f_code.co_name != "get":
            time.sleep(0.001)
        time.sleep(0.01)  # into the wait itself (a failure only if it crashes)
        sel = spindle.Select([rx])
        t.join(BOUND)
        assert not t.is_alive() and len(errors) == 1
        assert "moved into a Select" in str(errors[0])
        router.context(router.id).send(rx.handle, b"to the select")
        assert sel.get(timeout=BOUND).data == b"to the select"
        sel.close()


def test_a_child_takes_pickles_from_its_parent_not_from_a_sibling(router):
    # Unpickling runs code: a sibling (or an ssh agent, or a spawn(argv=...)
    # program) could run its own code in this child with a crafted pickle.
    keeper = router.fork(keeping_main, name="keeper")
    sibling = router.fork(name="sibling")
    inbox = keeper.call("inbox")
    assert sibling.call(send_each, inbox, [{1, 2}, "plain"]) == 2  # a set is pickled
    inbox.send({3})  # from the parent: taken
    kept = keeper.call("first", 3)
    assert kept[0][0] == "refused" and f"from context {sibling.id}" in kept[0][1], kept
    assert kept[1:] == [["value", "'plain'"], ["value", "{3}"]]
    keeper.stop()
    sibling.stop()


def test_a_childs_send_to_a_closed_receiver_comes_back_dead(router, child):
    rx = router.receiver()
    s = rx.sender
    rx.close()
    with router.receiver() as replies:
        # The child cannot hear of it without reply_to: a fire-and-forget send.
        assert child.call(send_each, s, [1]) == 1
        router.context(router.id).send(s.handle, 2, reply_to=replies)
        with pytest.raises(spindle.ChannelError):
            replies.get(timeout=BOUND)


def test_send_checks_its_arguments_before_sending(router):
    me = router.context(router.id)
    with router.receiver() as rx:
        with pytest.raises(TypeError):
            me.send(rx.handle, 1, fds=["not an fd"])
        with pytest.raises(TypeError):
            me.send(rx.handle, 1, fds=5)
        with pytest.raises(ValueError, match="253"):
            me.send(rx.handle, 1, fds=[0] * 254)
        with pytest.raises((TypeError, AttributeError, pickle.PicklingError)):
            me.send(rx.handle, lambda: 0)  # msgpack cannot hold it, pickle neither (as for calls)
        with pytest.raises(spindle.TimeoutError):
            rx.get(timeout=0)  # nothing was sent


def test_a_routers_receiver_takes_pickled_values(router):
    """As for calls: a Router accepts pickle (from its own children and itself)."""
    with router.receiver() as rx:
        router.context(router.id).send(rx.handle, {1, 2})
        assert rx.get(timeout=BOUND).data == {1, 2}


def test_closed_router_closes_its_receivers():
    with spindle.Router() as r:
        rx = r.receiver()
    assert rx.closed
    with pytest.raises(spindle.ShutdownError):
        r.receiver()


def test_env_receiver_in_a_spawned_child(router):
    child = router.spawn(main="test_messages:echo_main")
    handle = child.call("rx_handle")
    with router.receiver() as rx:
        child.send(handle, [rx.sender, 5])
        assert rx.get(timeout=BOUND).data == 10
    child.stop()


def test_messages_between_router_clients_refuse_pickle(router_socket):
    with spindle.connect(router_socket, name="rx-side") as a, spindle.connect(router_socket) as b:
        with a.receiver() as rx:
            to_a = b.context(a.id)
            to_a.send(rx.handle, {"msgpack": [1, 2]})
            assert rx.get(timeout=BOUND).data == {"msgpack": [1, 2]}
            to_a.send(rx.handle, {1, 2})  # a set: pickled, which a client refuses
            with pytest.raises(spindle.PickleRefusedError, match="allow_pickle=True"):
                rx.get(timeout=BOUND)
            to_a.send(rx.handle, "after")  # the receiver goes on
            msg = rx.get(timeout=BOUND)
            assert msg.data == "after" and msg.src_id == b.id


def test_a_send_waiting_for_queue_space_lets_other_threads_run(router):
    """A small send keeps the GIL (cheaper than handing it to another thread
    and back), but never while it waits: a stopped child reads nothing, its
    queue fills, and the sending thread waits there while this thread goes on
    running Python. Held through that wait, the GIL would stop this thread
    until the send gave up."""
    child = router.fork(counting_main)
    handle = child.call("rx_handle")
    chunk = b"x" * 60000  # small enough to keep the GIL; 600 of them pass the 8 MiB mark
    total = 600
    sent = [0]
    errors = []

    def send_all():
        try:
            for _ in range(total):
                child.send(handle, chunk)
                sent[0] += 1
        except Exception as e:  # noqa: B902 - reported by the assertion below
            errors.append(e)

    os.kill(child.pid, signal.SIGSTOP)
    sender = threading.Thread(target=send_all, daemon=True)
    try:
        sender.start()
        # Until the sender has filled the queue (8 MiB, the default mark) and
        # stopped there: it waits for the stopped child, not for the CPU.
        at_mark = (8 << 20) // len(chunk)
        deadline = time.monotonic() + BOUND
        last, still_since = -1, time.monotonic()
        while last < at_mark or time.monotonic() - still_since < 0.5:
            assert time.monotonic() < deadline and not errors, (last, errors)
            if sent[0] != last:
                last, still_since = sent[0], time.monotonic()
            time.sleep(0.01)
        assert last < total
        # Pure Python, which needs the GIL, runs while the sender still waits.
        spins, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < 0.2:
            spins += 1
        assert spins > 1000
        assert sent[0] == last and sender.is_alive()
    finally:
        os.kill(child.pid, signal.SIGCONT)
    sender.join(BOUND)
    assert not sender.is_alive() and not errors and sent[0] == total
    deadline = time.monotonic() + BOUND
    while child.call("count") < total:
        assert time.monotonic() < deadline
        time.sleep(0.01)
