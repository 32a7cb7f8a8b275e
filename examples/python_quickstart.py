"""Spindle from Python: fork and spawn children, call them, handle errors.

Run from a build tree (the package sits beside the built extension):

    PYTHONPATH=build/python /usr/bin/python3 examples/python_quickstart.py

or, once installed (cmake --install), with plain /usr/bin/python3.
"""

import asyncio
import os

import spindle


def square(n):
    """Module-level: the child imports it by module and name, then runs it."""
    return n * n


def where():
    return os.getpid()


def fails():
    raise ValueError("not today")


@spindle.expose("greet")  # callable by name, from Python or C++
def greet(name):
    return f"hello, {name}"


def main():
    with spindle.Router() as router:
        child = router.fork(name="worker")
        print("square(7) =", child.call(square, 7))
        print("parent", os.getpid(), "child", child.call(where))
        print(child.call("greet", "world"))

        futures = [child.call_async(square, i) for i in range(5)]
        print("async:", [f.result(timeout=30) for f in futures])

        async def use_asyncio():
            return await child.acall(square, 12)
        print("asyncio:", asyncio.run(use_asyncio()))

        try:
            child.call(fails)
        except spindle.CallError as e:
            print(f"remote {e.remote_type}: {e.message}")

        # A fresh interpreter: `python3 -m spindle.child`. It imports what it
        # runs, so it calls functions of importable modules (not __main__'s).
        fresh = router.spawn(name="fresh")
        print("spawned child runs os.getpid:", fresh.call(os.getpid) == fresh.pid)
    # Leaving the block stops the children: SHUTDOWN, then reaped.


if __name__ == "__main__":
    main()
