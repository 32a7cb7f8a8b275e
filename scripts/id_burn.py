#!/usr/bin/env python3
"""How fast one hostile client makes a spindle-router spend context ids.

It plays a stock Mitogen client (the 4-byte hello), and on each connection
sends 1,024 ALLOCATE_ID requests without reply_to (each spends an id and
gets no answer; 1,024 is what a link may hold unannounced), then leaves, and
connects again. It prints the ids spent per second and how long all 2^32
would take: the figure behind docs/PROTOCOL.md 7.3.2, where the root goes
round the id space instead of stopping at its end.

    build/spindle-router --socket /tmp/r.sock &
    python3 scripts/id_burn.py /tmp/r.sock 10

Only for a router of your own: it is a denial-of-service probe.
"""
import os
import socket
import struct
import sys
import time

HEADER = struct.Struct(">hLLLLLL")  # magic, dst, src, auth, handle, reply_to, length
MAGIC, ALLOCATE_ID, WINDOW = 0x4D49, 105, 1024


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: id_burn.py SOCKET SECONDS")
    path, seconds = sys.argv[1], float(sys.argv[2])
    first_id = last_id = None
    connections, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < seconds:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(path)
            s.sendall(struct.pack(">L", os.getpid()))
            reply = b""
            while len(reply) < 12:
                chunk = s.recv(12 - len(reply))
                if not chunk:
                    sys.exit("the router closed the connection during the handshake")
                reply += chunk
            my_id = struct.unpack(">L", reply[:4])[0]
            first_id = my_id if first_id is None else first_id
            last_id = my_id
            s.sendall(HEADER.pack(MAGIC, 0, my_id, my_id, ALLOCATE_ID, 0, 0) * WINDOW)
            s.shutdown(socket.SHUT_WR)
            while s.recv(65536):
                pass
        connections += 1
    elapsed = time.monotonic() - t0
    rate = (last_id - first_id) / elapsed
    print(f"{connections} connections in {elapsed:.1f} s; ids {first_id} -> {last_id}: {rate:,.0f} ids/s; "
          f"all 2^32 in {2**32 / rate / 60:.0f} min" if rate > 0 else "no ids spent")


if __name__ == "__main__":
    main()
