"""A DataLoader-like pipeline: 8 forked workers make numpy batches, the
parent consumes them in order, and a worker killed with -9 is replaced.

Each worker fills a batch straight into a memfd (spindle.Buffer) and returns
it: the reply's body is that sealed memfd, so the batch is never copied, and
the parent reads it as a read-only view of the same pages. The parent keeps
a few batches per worker in flight (call_async) and takes the futures in
batch order. When a worker dies, its pending calls fail at once with
spindle.ChannelError: the parent reports it by name, reaps it, forks a
replacement under the same name and sends it the dead worker's batches.
Nothing leaks: a memfd goes with the last process that maps it, so there is
nothing in /dev/shm to clean, and the script checks that its fds, /dev/shm
and its children are as they were before.

    PYTHONPATH=build/python /usr/bin/python3 examples/python/loader.py

(It runs as the ctest example.python_loader, which kills one worker mid-run.)
"""

import collections
import concurrent.futures
import os
import signal
import sys
import time

import numpy as np

import spindle

WORKERS = 8
BATCHES = 200
SHAPE = (256, 1024)  # float32: 1 MiB, the size from which a buffer travels as a memfd
KILL_AT = 50         # the parent kills one worker with -9 after consuming this batch


def fill(out, index):
    """The "dataset": batch `index` is its index everywhere but column 0, the row numbers."""
    out[:] = index
    out[:, 0] = np.arange(SHAPE[0])


def make_batch(index):
    """Runs in a worker: fills a batch in place and returns it without a copy."""
    buf = spindle.Buffer(shape=SHAPE, dtype=np.float32)  # over a fresh memfd
    fill(buf.array, index)
    return buf  # the sealed memfd is the reply itself: zero copies


def check(batch, index):
    if batch.shape != SHAPE or not (batch[:, 1:] == index).all() or \
            not (batch[:, 0] == np.arange(SHAPE[0])).all():
        sys.exit(f"loader: batch {index} has the wrong contents")


def load(router):
    workers = [router.fork(name=f"worker-{w}") for w in range(WORKERS)]
    pending = collections.deque()  # (index, worker number, future), in batch order
    submitted = 0
    replaced = []

    def start(w, index):
        try:
            return workers[w].call_async(make_batch, index)
        except spindle.ChannelError as e:  # already known dead: fail like a pending call
            future = concurrent.futures.Future()
            # Without its traceback, which holds this frame, which holds the
            # future: a cycle only the garbage collector frees, and with it
            # every frame the exception is raised through later (load's, whose
            # last future holds a batch, a memfd: the fd check found it).
            future.set_exception(e.with_traceback(None))
            return future

    def submit(index, w):
        pending.append((index, w, start(w, index)))

    for index in range(BATCHES):
        while submitted < BATCHES and submitted < index + 2 * WORKERS:  # prefetch
            submit(submitted, submitted % WORKERS)
            submitted += 1
        i, w, future = pending.popleft()
        try:
            reply = future.result()
        except spindle.ChannelError as e:  # the worker died: its calls fail at once
            dead = workers[w]
            status = dead.stop()  # reaps it
            print(f"loader: {dead.name} (pid {dead.pid}) died "
                  f"({os.waitstatus_to_exitcode(status)}): {e}; replacing it")
            workers[w] = router.fork(name=dead.name)
            replaced.append(dead.name)
            # Its batches go to the replacement, keeping their places in the order.
            pending = collections.deque((j, v, start(v, j)) if v == w else (j, v, f)
                                        for j, v, f in pending)
            reply = workers[w].call(make_batch, i)
        check(reply, i)  # a read-only array over the worker's memfd: no copy
        del reply  # unmaps it (the memfd goes with the last mapping)
        if i == KILL_AT:
            victim = workers[3]
            print(f"loader: kill -9 {victim.name} (pid {victim.pid})")
            os.kill(victim.pid, signal.SIGKILL)
    return replaced


def snapshot():
    return sorted(os.listdir("/proc/self/fd")), set(os.listdir("/dev/shm"))


def main():
    fds_before, shm_before = snapshot()
    t = time.monotonic()
    with spindle.Router() as router:
        replaced = load(router)
    elapsed = time.monotonic() - t
    print(f"loader: {BATCHES} batches of {np.prod(SHAPE) * 4 >> 20} MiB in order from {WORKERS} "
          f"workers in {elapsed:.2f} s")

    if replaced != ["worker-3"]:
        sys.exit(f"loader: expected worker-3 to be replaced once, got {replaced}")
    # Nothing left behind: our fds, /dev/shm (others may be using it too, so
    # a new entry gets a moment to go), and no children, zombie or alive.
    fds_after, shm_after = snapshot()
    if fds_after != fds_before:
        sys.exit(f"loader: fds before {fds_before}, after {fds_after}")
    for _ in range(20):
        if not shm_after - shm_before:
            break
        time.sleep(0.1)
        shm_after = snapshot()[1]
    else:
        sys.exit(f"loader: left in /dev/shm: {sorted(shm_after - shm_before)}")
    try:
        pid, _ = os.waitpid(-1, os.WNOHANG)
        sys.exit(f"loader: a child is left (pid {pid} or another)")
    except ChildProcessError:
        pass  # none
    print("loader: every batch in order and right; worker-3 replaced; no fds, /dev/shm files "
          "or children left")


if __name__ == "__main__":
    main()
