"""Shared fixtures of the spindle binding's tests."""

import os

import pytest

import spindle


@pytest.fixture
def router():
    with spindle.Router() as r:
        yield r


@pytest.fixture(params=["fork", "spawn"])
def child(request, router):
    """A Python child, forked and spawned: every test that takes it runs twice."""
    c = router.fork(name="py-fork") if request.param == "fork" else router.spawn(name="py-spawn")
    yield c
    c.stop()


def helper(name):
    """The path of a C++ program built from tests/helpers/<name>.cpp."""
    path = os.path.join(os.environ["SPINDLE_HELPER_DIR"], name)
    if not os.access(path, os.X_OK):
        pytest.fail(f"{path} is not built (ninja {name})")
    return path
