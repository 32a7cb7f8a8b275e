"""spindle.Buffer: a producer fills a memfd in place, and that memfd is the message.

Zero copies is checked where it can be seen: the parent's view of a result
lies in a mapping of the very memfd (same inode) that the child filled.
"""

import os
import zlib

import numpy
import pytest

import spindle
from spindle import _spindle

import pyfuncs

MIB = 1 << 20

# The child's last Buffer, kept so the test can ask which memfd it is.
_kept = None


def make_buffer(nbytes, seed):
    global _kept
    _kept = spindle.Buffer(nbytes)
    _kept.array[:] = numpy.arange(nbytes, dtype=numpy.uint64).astype(numpy.uint8) ^ seed
    return _kept


def make_batch(shape, value):
    global _kept
    _kept = spindle.Buffer(shape=tuple(shape), dtype="float32")
    _kept.array[...] = value
    return _kept


def send_buffer(sender, nbytes, seed):
    sender.send(make_buffer(nbytes, seed))


def kept_mapping():
    """The /proc/self/maps line of the child's last Buffer (dev and inode)."""
    return pyfuncs.mapping_of(pyfuncs.address_of(_kept))


def crc_of(buf):
    return zlib.crc32(memoryview(buf).cast("B"))


def expected(nbytes, seed):
    return numpy.arange(nbytes, dtype=numpy.uint64).astype(numpy.uint8) ^ seed


def test_a_buffer_is_writable_and_knows_its_shape():
    buf = spindle.Buffer(3 * MIB)
    assert len(buf) == 3 * MIB and not buf.sealed
    view = memoryview(buf)
    assert not view.readonly and view.nbytes == 3 * MIB
    view[0] = 7
    assert buf.array[0] == 7 and buf.array.dtype == numpy.uint8
    batch = spindle.Buffer(shape=(4, 256, 256), dtype="float32")
    assert len(batch) == 4 * 256 * 256 * 4
    assert batch.array.shape == (4, 256, 256) and batch.array.dtype == numpy.float32
    assert pyfuncs.address_of(batch.array) % os.sysconf("SC_PAGESIZE") == 0, "data start on a page"


@pytest.mark.parametrize("args, kwargs, error", [
    ((), {}, TypeError),
    ((10,), {"shape": (10,)}, TypeError),
    ((10,), {"dtype": "float32"}, TypeError),
    ((-1,), {}, ValueError),
    ((), {"shape": (2, -3)}, ValueError),
    ((), {"shape": (2,), "dtype": object}, TypeError),
    ((1 << 33,), {}, ValueError),
])
def test_bad_arguments_are_clear_errors(args, kwargs, error):
    with pytest.raises(error, match="spindle.Buffer"):
        spindle.Buffer(*args, **kwargs)


def test_on_its_own_a_buffer_packs_as_its_sealed_memfd():
    buf = spindle.Buffer(2 * MIB)
    buf.array[:] = 5
    packed = _spindle.pack(buf, None)
    assert buf.sealed and packed.is_memfd and packed.slices == 1
    assert len(packed) == len(buf) + os.sysconf("SC_PAGESIZE"), "the value's header fills one page"
    back = _spindle.unpack(packed, None)
    assert isinstance(back, memoryview) and back.readonly and back.nbytes == 2 * MIB
    assert bytes(back[:3]) == b"\x05\x05\x05"


def test_after_sealing_writes_stay_in_this_process():
    buf = spindle.Buffer(MIB)
    buf.array[:] = 1
    sent = _spindle.pack(buf, None)
    buf.array[:] = 2  # the process's private copy now
    assert bytes(_spindle.unpack(sent, None)[:2]) == b"\x01\x01"
    assert buf.array[0] == 2
    again = _spindle.pack(buf, None)
    assert bytes(_spindle.unpack(again, None)[:2]) == b"\x01\x01", "every send carries what was sealed"


def test_inside_a_larger_value_it_is_its_inner_value():
    buf = spindle.Buffer(shape=(512, 1024), dtype="<f4")
    buf.array[:] = 0.5
    packed = _spindle.pack(["batch", 3, buf], None)
    assert packed.slices == 2 and not packed.is_memfd
    name, index, arr = _spindle.unpack(packed, None)
    assert (name, index) == ("batch", 3)
    assert isinstance(arr, numpy.ndarray) and arr.shape == (512, 1024) and arr.dtype == numpy.dtype("<f4")
    assert float(arr.sum()) == 512 * 1024 * 0.5 and not arr.flags.writeable


def test_a_malformed_padded_value_is_refused():
    # ext 8, length 5, type 83, pad_len 9: the pad runs past the end.
    with pytest.raises(ValueError, match="malformed padded value"):
        _spindle.unpack(bytes.fromhex("c705530009c0c0c0"), None)


def test_a_returned_buffer_is_the_reply_itself(child):
    nbytes = 64 * MIB
    view = child.with_timeout(60).call(make_buffer, nbytes, 0x5a)
    assert isinstance(view, memoryview) and view.readonly and view.nbytes == nbytes
    assert numpy.array_equal(numpy.frombuffer(view, dtype=numpy.uint8), expected(nbytes, 0x5a))
    mine = pyfuncs.mapping_of(pyfuncs.address_of(view))
    # 64 MiB held here pause the link from the child (its memory limit): let
    # the view go before the next call, or its reply waits for the release.
    del view
    theirs = child.call(kept_mapping)
    assert "memfd:spindle-payload" in mine["path"], mine
    assert (mine["dev"], mine["inode"]) == (theirs["dev"], theirs["inode"]), \
        "the parent maps the memfd the child filled: no copy on the way"


def test_a_returned_batch_arrives_as_a_read_only_array(child):
    arr = child.with_timeout(60).call(make_batch, [8, 3, 64, 64], 1.25)
    assert isinstance(arr, numpy.ndarray) and arr.shape == (8, 3, 64, 64) and arr.dtype == numpy.float32
    assert not arr.flags.writeable and float(arr.min()) == float(arr.max()) == 1.25


def test_a_buffer_argument_is_copied_once_and_arrives_intact(child):
    buf = spindle.Buffer(8 * MIB)
    buf.array[:] = expected(8 * MIB, 3)
    assert child.with_timeout(60).call(crc_of, buf) == crc_of(expected(8 * MIB, 3))
    assert buf.sealed


def test_a_sent_buffer_is_the_message_itself(router, child):
    nbytes = 16 * MIB
    with router.receiver() as rx:
        child.with_timeout(60).call(send_buffer, rx.sender, nbytes, 0x33)
        msg = rx.get(timeout=60)
        view = msg.data
        assert isinstance(view, memoryview) and view.readonly and view.nbytes == nbytes
        assert numpy.array_equal(numpy.frombuffer(view, dtype=numpy.uint8), expected(nbytes, 0x33))
        mine = pyfuncs.mapping_of(pyfuncs.address_of(view))
        del view, msg
    theirs = child.call(kept_mapping)
    assert (mine["dev"], mine["inode"]) == (theirs["dev"], theirs["inode"]), \
        "the receiver maps the memfd the child filled: no copy on the way"


def test_a_buffer_made_before_a_fork_is_sent_as_a_sealed_copy(router):
    """The forked process still maps it writable, so it cannot be sealed as it
    is: the message is a sealed copy of its bytes (it used to be an error)."""
    nbytes = 4 * MIB
    buf = spindle.Buffer(nbytes)
    buf.array[:] = expected(nbytes, 9)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # keeps the inherited mapping until the parent has sent
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    try:
        with router.receiver() as rx:
            rx.sender.send(buf)
            view = rx.get(timeout=60).data
            assert isinstance(view, memoryview) and view.readonly and view.nbytes == nbytes
            assert numpy.array_equal(numpy.frombuffer(view, dtype=numpy.uint8), expected(nbytes, 9))
            del view
    finally:
        os.close(w)
        os.waitpid(pid, 0)
    assert buf.sealed


def test_references_dropped_without_the_gil_are_all_released():
    """The broker thread lets go of a sent buffer (or a handler) without the
    GIL; the interpreter drops the reference later, on its main thread. Each
    used to take a slot of the interpreter's pending-call queue, which holds
    32: while the main thread waited, every reference past the 32nd leaked
    (a whole array, for a buffer sent to a peer that cannot take fds)."""
    import gc
    import time
    import weakref

    class Held:
        pass

    objects = [Held() for _ in range(200)]
    refs = [weakref.ref(o) for o in objects]
    _spindle._release_on_another_thread(objects)
    del objects  # only the dropped references were left
    deadline = time.monotonic() + 10
    while any(r() is not None for r in refs) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)  # bytecode runs, and the interpreter's pending calls with it
    assert sum(r() is not None for r in refs) == 0
