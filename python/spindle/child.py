"""The child program router.spawn() starts: ``python3 -m spindle.child``.

It attaches to its parent over the link spawn_child() set up (SPINDLE_FD)
and serves module-level functions (ctx.call(fn, ...)) and the functions
@spindle.expose registered, until the parent says SHUTDOWN. With
``--main module:function`` it runs function(env) instead, which exposes what
it wants and returns env.serve(). A C++ parent starts it the same way:
``rt.spawn_child("/usr/bin/python3", {"-m", "spindle.child"})``.
"""

import argparse
import importlib
import sys

import spindle
from spindle import _spindle


def _resolve(spec):
    module, sep, qualname = spec.partition(":")
    if not sep or not module or not qualname:
        raise SystemExit(f"spindle.child: --main takes module:function, not {spec!r}")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python3 -m spindle.child", description=__doc__.split("\n")[0])
    parser.add_argument("--main", help="module:function run as function(env) instead of serving")
    parser.add_argument("--import", dest="imports", action="append", default=[],
                        help="a module to import first (its @spindle.expose functions are served)")
    parser.add_argument("--max-message-size", type=int, default=None,
                        help="the largest message taken from the parent (router.spawn() passes its own)")
    args = parser.parse_args(argv)
    for name in args.imports:
        importlib.import_module(name)
    target = _resolve(args.main) if args.main else None
    if args.max_message_size is None:
        return _spindle.run_spawned_child(spindle._child_main(target))
    return _spindle.run_spawned_child(spindle._child_main(target), args.max_message_size)


if __name__ == "__main__":
    sys.exit(main())
