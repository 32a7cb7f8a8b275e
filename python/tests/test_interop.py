"""Python and C++ call each other: the same msgpack as the C++ typed calls."""

import subprocess
import sys

import numpy
import pytest

import spindle
import pyfuncs
from conftest import helper


def test_python_parent_calls_cpp_child(router):
    c = router.spawn(argv=[helper("py_peer"), "serve"], name="cpp")
    assert c.call("square", 12) == 144
    assert c.call("geo.mirror", {"x": 1, "y": 2}) == {"x": 2, "y": 1}
    # numpy's integers and floats travel as msgpack numbers, not pickled.
    assert c.call("square", numpy.int64(5)) == 25
    assert c.call("geo.mirror", {"x": numpy.int32(3), "y": numpy.uint8(4)}) == {"x": 4, "y": 3}
    with pytest.raises(spindle.CallError) as info:
        c.call("fail", "no reason")
    assert (info.value.remote_type, info.value.message) == ("std::invalid_argument", "no reason")
    with pytest.raises(spindle.CallError) as info:
        c.call("square", "twelve")
    assert info.value.remote_type == "spindle::DecodeError"
    # A pickled argument is msgpack ext 80, which C++ does not decode.
    with pytest.raises(spindle.CallError) as info:
        c.call("square", pyfuncs.Point(1, 2))
    assert info.value.remote_type == "spindle::DecodeError"
    # A large buffer is an ordinary bin to C++ (its bytes a slice of their
    # own on the Python side), and a large bin comes back as a memoryview.
    blob = bytes(range(256)) * (8 << 12)  # 8 MiB
    back = c.call("blob.reversed", numpy.frombuffer(blob, dtype=numpy.uint8).copy().data)
    assert isinstance(back, memoryview) and back.readonly and bytes(back) == blob[::-1]
    # A C++ child serves no Python module functions.
    with pytest.raises(spindle.ChannelError, match="unknown service: py"):
        c.call(pyfuncs.square, 2)
    assert c.stop() == 0


def test_no_pickle_from_a_child_that_is_not_python(router):
    # spawn(argv=...) runs a program this package does not vouch for: what it
    # sends is not unpickled (unpickling runs code), while its plain values are.
    c = router.spawn(argv=[helper("py_peer"), "serve"], name="cpp")
    assert c.call("args_back", 1, "two") == [1, "two"]
    with pytest.raises(spindle.PickleRefusedError, match=f"from context {c.id}"):
        c.call("args_back", pyfuncs.Point(1, 2))
    with pytest.raises(spindle.PickleRefusedError, match=f"from context {c.id}"):
        c.call_async("args_back", pyfuncs.Point(1, 2)).result(timeout=30)
    # A Python child's pickles are taken.
    py = router.fork()
    assert py.call(pyfuncs.echo, pyfuncs.Point(1, 2)) == pyfuncs.Point(1, 2)
    assert c.stop() == 0


def test_a_python_sender_reaches_a_cpp_child(router):
    # ext 84 both ways: a C++ child's spindle::Sender<long> parameter takes a
    # Python Sender (test_cpp_parent_calls_python_child does the reverse).
    c = router.spawn(argv=[helper("py_peer"), "serve"], name="cpp")
    with router.receiver() as rx:
        c.call("count_to", rx.sender, 4)
        assert [rx.get(timeout=30).data for _ in range(4)] == [1, 2, 3, 4]
    assert c.stop() == 0


def test_python_parent_calls_spawned_typed(router):
    c = router.spawn(argv=[helper("spawned_typed")])
    assert c.call("echo", "hi there") == "hi there"
    assert c.call_async("echo", "later").result(timeout=30) == "later"


def test_cpp_parent_calls_python_child():
    out = subprocess.run([helper("py_peer"), "call-python", sys.executable],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
