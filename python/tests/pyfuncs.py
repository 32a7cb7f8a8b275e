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
