"""Large buffers travel as a sealed memfd and arrive as a read-only view of it."""

import json
import os
import subprocess
import sys
import textwrap
import zlib

import numpy
import pytest

import spindle
from spindle import _spindle
import pyfuncs

MIB = 1 << 20
BIG = 256 * MIB
# The receiver's peak RSS may grow by the payload (its mapping) and some
# slack, never by two payloads (a copy besides the mapping).
RSS_LIMIT = BIG + BIG // 2
# A call's arguments queue in the callee's service lane, whose 64 MiB bound
# admits one message of any size into an empty lane (services/lanes.h): a
# 256 MiB argument goes through like a 256 MiB result.
BIG_ARG = BIG


def test_a_large_buffer_is_referenced_not_copied_into_the_msgpack():
    big = numpy.zeros(4 * MIB, dtype=numpy.uint8)
    packed = _spindle.pack([big], None)
    # The msgpack around it, then the array's own memory: two slices.
    assert packed.slices == 2 and len(packed) > big.nbytes
    assert _spindle.pack([b"small"], None).slices == 1


def test_a_small_bytes_value_still_travels_inline(child):
    value = b"\x00\xff" * 100
    back = child.call(pyfuncs.echo, value)
    assert type(back) is bytes and back == value
    assert child.call(pyfuncs.echo, bytearray(b"abc")) == b"abc"


def test_a_256_mib_array_argument_arrives_as_a_read_only_memfd_view(child):
    child.call(pyfuncs.max_rss)  # the child has imported what it needs
    before = child.call(pyfuncs.max_rss)
    arr = pyfuncs.make_array(BIG_ARG).reshape(-1, 1024)
    crc = zlib.crc32(memoryview(arr).cast("B"))
    info = child.with_timeout(120).call(pyfuncs.describe_buffer, arr)
    assert info["type"] == "ndarray" and info["dtype"] == arr.dtype.str and info["shape"] == list(arr.shape)
    assert info["crc"] == crc and info["nbytes"] == BIG_ARG
    assert info["readonly"] is True
    assert "memfd:spindle-payload" in info["mapping"]
    assert info["max_rss"] - before < RSS_LIMIT, (before, info["max_rss"])
    print(f"\n256 MiB argument: receiver max RSS +{(info['max_rss'] - before) / MIB:.0f} MiB")


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview"])
def test_large_bytes_like_arguments_arrive_as_memoryviews(child, kind):
    data = pyfuncs.make_bytes(8 * MIB)
    value = {"bytes": data, "bytearray": bytearray(data), "memoryview": memoryview(data)}[kind]
    info = child.call(pyfuncs.describe_buffer, value)
    assert info["type"] == "memoryview" and info["readonly"] is True
    assert info["crc"] == zlib.crc32(data)
    assert "memfd:spindle-payload" in info["mapping"]


@pytest.mark.parametrize("kind", ["array.array", "mmap"])
def test_any_object_with_the_buffer_protocol_travels_as_a_memfd(child, kind):
    # Neither bytes-like nor numpy: the generic buffer-protocol path.
    import array
    import mmap
    data = pyfuncs.make_bytes(4 * MIB)
    if kind == "array.array":
        value = array.array("B", data)
    else:
        value = mmap.mmap(-1, len(data))
        value.write(data)
    try:
        info = child.call(pyfuncs.describe_buffer, value)
    finally:
        if kind == "mmap":
            value.close()
    assert info["type"] == "memoryview" and info["readonly"] is True
    assert info["crc"] == zlib.crc32(data) and info["nbytes"] == len(data)
    assert "memfd:spindle-payload" in info["mapping"]


def test_a_small_array_is_pickled_as_before(child):
    arr = numpy.arange(10, dtype=numpy.float32).reshape(2, 5)
    back = child.call(pyfuncs.echo, arr)
    assert back.dtype == arr.dtype and (back == arr).all() and back.flags.writeable
    assert child.call(pyfuncs.echo, numpy.int64(7)) == 7  # __index__: a msgpack int


def test_an_array_inside_a_pickled_object_travels_out_of_band(child):
    arr = pyfuncs.make_array(16 * MIB)
    point = pyfuncs.Point(arr, "label")
    packed = _spindle.pack([point], spindle.errors._pickle_dumps)
    assert packed.slices == 2  # the pickle stream, then the array's own memory
    info = child.call(pyfuncs.describe_x, point)
    assert info["type"] == "ndarray" and info["readonly"] is True
    assert info["crc"] == zlib.crc32(memoryview(arr).cast("B"))
    assert "memfd:spindle-payload" in info["mapping"]
    back = child.call(pyfuncs.echo, point)  # and back again, the same way
    assert back.y == "label" and (back.x == arr).all() and not back.x.flags.writeable
    assert "memfd:spindle-payload" in pyfuncs.memfd_mapping_of(pyfuncs.address_of(back.x))
    del back


def test_a_strided_array_arrives_with_its_values():
    arr = numpy.arange(2 * MIB, dtype=numpy.int32)[::2]  # not contiguous: one copy when sent
    with spindle.Router() as router:
        child = router.fork()
        back = child.call(pyfuncs.echo, arr)
        child.stop()
    assert back.dtype == arr.dtype and back.shape == arr.shape and (back == arr).all()
    assert not back.flags.writeable


# The receiver of the result is the parent here, measured in a process of
# its own so that no earlier test's arrays count in its peak RSS.
RESULT_SCRIPT = textwrap.dedent("""
    import json, time, zlib
    import numpy
    import spindle, pyfuncs
    with spindle.Router() as router:
        child = router.spawn(name="producer")
        child.call(pyfuncs.getpid)
        before = pyfuncs.max_rss()
        t0 = time.monotonic()
        arr = child.with_timeout(120).call(pyfuncs.make_array, %d)
        seconds = time.monotonic() - t0
        out = {"seconds": seconds, "max_rss_delta": pyfuncs.max_rss() - before,
               "readonly": not arr.flags.writeable, "dtype": arr.dtype.str,
               "shape": list(arr.shape), "crc": zlib.crc32(memoryview(arr).cast("B")),
               "mapping": pyfuncs.memfd_mapping_of(pyfuncs.address_of(arr))}
        del arr
        child.stop()
    print(json.dumps(out))
""")


def test_a_function_returning_a_256_mib_array():
    proc = subprocess.run([sys.executable, "-c", RESULT_SCRIPT % BIG], capture_output=True, text=True,
                          timeout=300, env=os.environ)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = pyfuncs.make_array(BIG)
    assert out["crc"] == zlib.crc32(memoryview(expected).cast("B"))
    del expected
    assert out["dtype"] == "<u8" and out["shape"] == [BIG // 8]
    assert out["readonly"] is True
    assert "memfd:spindle-payload" in out["mapping"]
    assert out["max_rss_delta"] < RSS_LIMIT, out
    print(f"\n256 MiB result: {out['seconds']:.3f} s, receiver max RSS +{out['max_rss_delta'] / MIB:.0f} MiB")


def test_a_received_view_keeps_its_mapping_alive(child):
    view = child.call(pyfuncs.make_bytes, 4 * MIB)
    assert isinstance(view, memoryview) and view.readonly
    address = pyfuncs.address_of(view)
    assert "memfd:spindle-payload" in pyfuncs.memfd_mapping_of(address)
    child.call(pyfuncs.make_bytes, 4 * MIB)  # other messages come and go
    assert bytes(view[:256]) == bytes(range(256))
    del view


def test_a_child_returning_its_received_argument_does_not_hold_it(child):
    # 96 MiB received and returned as they are: the reply carries the child's
    # view of the received memfd. Before, that view was released only when the
    # child next ran Python, so the body stayed charged to the parent's link,
    # the child stopped reading from the parent, and the next call never came.
    arr = numpy.arange(12 * MIB, dtype=numpy.int64)  # 96 MiB
    back = child.with_timeout(60).call(pyfuncs.echo, arr)
    assert back.shape == arr.shape and int(back[-1]) == 12 * MIB - 1
    del back
    assert child.with_timeout(20).call(pyfuncs.square, 9) == 81
