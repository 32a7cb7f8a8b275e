#!/usr/bin/python3
"""A stock Mitogen 0.3 process, driven line by line by test_mitogen_interop.cpp.

It connects to spindle-router with mitogen.unix.connect(), exactly as a
Mitogen user would, and answers commands read from stdin:

  CALL <dst> <handle> <text>  send <text> (pickled) to <dst>:<handle> with a
                              reply_to, print "REPLY <text>" or
                              "CHANNELERROR <reason>" or "TIMEOUT"
  WATCH <id>                  print "DISCONNECT <id>" when <id> disconnects
  EXIT                        shut down and exit 0

Messages arriving on its own receiver are printed as "GOT <src> <text>" and
answered with "ack:<text>".
"""
import sys
import threading

import mitogen.core
import mitogen.unix

lock = threading.Lock()


def say(*words):
    with lock:
        sys.stdout.write(" ".join(str(w) for w in words) + "\n")
        sys.stdout.flush()


def serve(recv):
    while True:
        try:
            msg = recv.get()
        except mitogen.core.ChannelError:
            return
        text = msg.unpickle()
        say("GOT", msg.src_id, text)
        msg.reply("ack:" + text)


def call(router, dst, handle, text):
    reply = mitogen.core.Receiver(router)
    router.route(mitogen.core.Message.pickled(
        text, dst_id=dst, handle=handle, reply_to=reply.handle))
    try:
        say("REPLY", reply.get(timeout=20).unpickle())
    except mitogen.core.ChannelError as e:
        say("CHANNELERROR", e)
    except mitogen.core.TimeoutError:
        say("TIMEOUT")
    finally:
        reply.close()


def main():
    router, parent = mitogen.unix.connect(sys.argv[1])
    recv = mitogen.core.Receiver(router)
    threading.Thread(target=serve, args=(recv,), daemon=True).start()
    say("READY", mitogen.context_id, recv.handle, mitogen.parent_id)
    for line in sys.stdin:
        words = line.split(" ", 3)
        cmd = words[0].strip()
        if cmd == "CALL":
            call(router, int(words[1]), int(words[2]), words[3].rstrip("\n"))
        elif cmd == "WATCH":
            target = int(words[1])
            ctx = router.context_by_id(target)
            mitogen.core.listen(ctx, "disconnect", lambda t=target: say("DISCONNECT", t))
            say("WATCHING", target)
        elif cmd == "EXIT":
            break
    router.broker.shutdown()
    router.broker.join()


if __name__ == "__main__":
    main()
