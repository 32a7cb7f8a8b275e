"""Functions the tests call in child processes.

A module of its own (not a test file) so that a spawned child imports it by
name: the tests' PYTHONPATH includes this directory.
"""

import os
import threading
import time

import spindle


def square(n):
    return n * n


def add(a, b=0, *, c=0):
    return a + b + c


def echo(value):
    return value


def getpid():
    return os.getpid()


def boom(text):
    raise ValueError(text)


def block_forever(fifo_path):
    """Says it is running (a byte into the FIFO fifo_path), then never returns."""
    with open(fifo_path, "wb") as f:
        f.write(b"!")
    threading.Event().wait()


def slow(seconds, value):
    time.sleep(seconds)
    return value


class Point:
    """Not msgpack: travels pickled, between a parent and its children."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __eq__(self, other):
        return isinstance(other, Point) and (self.x, self.y) == (other.x, other.y)


def make_point(x, y):
    return Point(x, y)


def point_sum(p):
    return p.x + p.y


@spindle.expose("py_square")
def py_square(n):
    return n * n


@spindle.expose("greet")
def greet(name):
    return f"hello {name}"


@spindle.expose("py_count_to")
def py_count_to(sender, n):
    """Sends 1..n through a Sender (a C++ spindle::Sender<long> from py_peer)."""
    assert isinstance(sender, spindle.Sender), type(sender)
    for i in range(1, n + 1):
        sender.send(i)


@spindle.expose("py_fail")
def py_fail(text):
    raise KeyError(text)


def custom_main(env):
    """A child main for router.fork(target=...) and spawn(main=...)."""
    env.expose("custom.triple", lambda n: 3 * n)
    return env.serve()


def exit_main(env):
    """A child main that leaves with sys.exit(7)."""
    import sys
    sys.exit(7)


def mapping_of(address):
    """The mapping of this process that holds `address`: its dev, inode and path (None if none)."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return {"dev": fields[3], "inode": fields[4], "path": fields[5].strip() if len(fields) > 5 else ""}
    return None


def memfd_mapping_of(address):
    """The path of the mapping of this process that holds `address` ("" if none)."""
    m = mapping_of(address)
    return m["path"] if m else ""


def address_of(buf):
    """The address of the first byte of an ndarray or a buffer."""
    import numpy
    arr = buf if isinstance(buf, numpy.ndarray) else numpy.frombuffer(buf, dtype=numpy.uint8)
    return arr.__array_interface__["data"][0]


def max_rss():
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def describe_buffer(buf):
    """What a receiver sees of a large argument: its checksum, type, and where it lives."""
    import zlib
    import numpy
    info = {"type": type(buf).__name__, "crc": zlib.crc32(memoryview(buf).cast("B")),
            "nbytes": memoryview(buf).nbytes, "readonly": memoryview(buf).readonly,
            "mapping": memfd_mapping_of(address_of(buf)), "max_rss": max_rss()}
    if isinstance(buf, numpy.ndarray):
        info["dtype"], info["shape"] = buf.dtype.str, list(buf.shape)
    return info


def make_array(nbytes):
    """A uint64 array of nbytes, 0, 1, 2, ... (its checksum is known to the caller)."""
    import numpy
    return numpy.arange(nbytes // 8, dtype=numpy.uint64)


def make_bytes(nbytes):
    return bytes(range(256)) * (nbytes // 256)


def describe_x(obj):
    """describe_buffer of obj.x: an array inside a pickled object."""
    return describe_buffer(obj.x)


def fork_holder():
    """Forks a process that keeps a copy of every fd of this one, the link to
    the parent's too, as a multiprocessing worker would; returns its pid. It
    ends itself after a minute if nobody kills it."""
    pid = os.fork()
    if pid == 0:
        import signal
        signal.alarm(60)
        while True:
            signal.pause()
    return pid
