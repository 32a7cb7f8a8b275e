// py_peer: the C++ side of the Python binding's interop tests
// (python/tests/test_interop.py), through <spindle/spindle.h> only.
//
//   py_peer serve          a child for spawn (the Python parent calls it):
//                            square(long) -> long
//                            geo.mirror(Point) -> Point   (a struct: a map)
//                            fail(string)                 throws std::invalid_argument
//                            blob.reversed(bytes) -> bytes (large: out of band in Python)
//                            count_to(Sender<long>, long) sends 1..n through a Python Sender
//   py_peer call-python PYTHON
//                          a C++ parent of `PYTHON -m spindle.child --import pyfuncs`:
//                          calls its Python functions by name, prints "ok" and
//                          exits 0, or says what differed and exits 1.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include <spindle/spindle.h>

namespace {

struct Point {
  long x = 0;
  long y = 0;
  MSGPACK_DEFINE_MAP(x, y)
};

inline constexpr spindle::method<long(long)> square{"square"};
inline constexpr spindle::method<Point(Point)> mirror{"geo.mirror"};
inline constexpr spindle::method<void(std::string)> fail{"fail"};
inline constexpr spindle::method<std::vector<char>(std::vector<char>)> reversed{"blob.reversed"};
inline constexpr spindle::method<void(spindle::Sender<long>, long)> count_to{"count_to"};

int serve() {
  return spindle::run_spawned_child([](spindle::ChildEnv& env) {
    env.expose(square, [](long n) { return n * n; });
    env.expose(mirror, [](Point p) { return Point{p.y, p.x}; });
    env.expose(fail, [](std::string why) { throw std::invalid_argument(why); });
    env.expose(reversed, [](std::vector<char> b) { return std::vector<char>(b.rbegin(), b.rend()); });
    env.expose(count_to, [](spindle::Sender<long> to, long n) {
      for (long i = 1; i <= n; ++i) to.send(i);
    });
    // Its arguments back as they came (one msgpack array), whatever they
    // hold: a program that is not Python can still send a pickle (ext 80).
    env.expose_encoded("args_back", spindle::Allow::kParent, [](const spindle::Payload& args) { return args; });
    return env.serve();
  });
}

int check(bool ok, const std::string& what) {
  if (!ok) std::fprintf(stderr, "py_peer: %s\n", what.c_str());
  return ok ? 0 : 1;
}

int call_python(const std::string& python) {
  spindle::Runtime rt;
  spindle::Child child = rt.spawn_child(python, {"-m", "spindle.child", "--import", "pyfuncs"},
                                        {.name = "python"});
  int bad = 0;
  long sq = child.call<long>("py_square", 7L);
  bad += check(sq == 49, "py_square(7) = " + std::to_string(sq));
  std::string hi = child.call<std::string>("greet", std::string("c++"));
  bad += check(hi == "hello c++", "greet = " + hi);
  // A module-level function, as a Python parent calls it: py.call(module,
  // qualified name, positional arguments, keyword arguments).
  long added = child.call<long>("py.call", std::string("pyfuncs"), std::string("add"),
                                std::vector<long>{1, 2}, std::map<std::string, long>{{"c", 3}});
  bad += check(added == 6, "py.call pyfuncs.add = " + std::to_string(added));
  try {
    child.call<long>("py_fail", std::string("gone"));
    bad += check(false, "py_fail returned");
  } catch (const spindle::CallError& e) {
    // The Python type on the wire; the text, then the Python traceback.
    bad += check(e.type() == "KeyError" && e.message().rfind("'gone'", 0) == 0 &&
                     std::strstr(e.message().c_str(), "--- remote traceback ---") != nullptr,
                 std::string("py_fail: ") + e.what());
  }
  try {
    child.call<long>("py_square", std::string("seven"));  // Python raises TypeError
    bad += check(false, "py_square(\"seven\") returned");
  } catch (const spindle::CallError& e) {
    bad += check(e.type() == "TypeError",
                 std::string("py_square(\"seven\"): ") + e.what());
  }
  // A C++ Receiver's Sender as an argument: the Python function sends
  // through it (a spindle.Sender there).
  spindle::Receiver<long> rx(rt);
  child.call<void>("py_count_to", rx.sender(), 3L);
  for (long i = 1; i <= 3; ++i) {
    auto v = rx.receive_for(std::chrono::seconds(30));
    bad += check(v && *v == i, "py_count_to: value " + std::to_string(i) + " = " +
                                   (v ? std::to_string(*v) : std::string("nothing in 30 s")));
  }
  int status = child.stop();
  bad += check(status == 0, "the Python child exited with status " + std::to_string(status));
  if (bad == 0) std::puts("ok");
  return bad == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::strcmp(argv[1], "serve") == 0) return serve();
  if (argc == 3 && std::strcmp(argv[1], "call-python") == 0) return call_python(argv[2]);
  std::fprintf(stderr, "usage: py_peer serve | py_peer call-python PYTHON\n");
  return 2;
}
