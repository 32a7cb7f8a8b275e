#!/usr/bin/env bash
# Install the Debian 12 packages Spindle needs to build and test.
# Idempotent: does nothing when everything is already installed.
set -euo pipefail

PACKAGES=(
  build-essential
  cmake
  ninja-build       # scripts/test.sh builds with Ninja when it is there
  pkg-config
  libasio-dev
  libboost-dev
  libspdlog-dev
  libgtest-dev
  googletest
  python3
  python3-mitogen   # the interop test runs stock Mitogen 0.3 against spindle-router
  clang             # scripts/fuzz.sh: the fuzzers are built with clang's libFuzzer
  libclang-rt-14-dev  # libFuzzer and clang's ASan/UBSan runtimes (libclang_rt.fuzzer*.a)
  libzmq3-dev       # bench_router's peer row: ZeroMQ's zmq_proxy beside spindle-router
  libmsgpack-cxx-dev  # typed calls: msgpack-c++ (header-only, used with MSGPACK_NO_BOOST)
  pybind11-dev      # the Python binding (python/): pybind11's headers and CMake config
  python3-dev       # ... and Python.h, which pybind11-dev does not pull in
  python3-pybind11  # ... and its Python package, for Debian's /usr/bin/python3
  python3-numpy     # the Python binding: numpy payloads (issue 14, part 2) and their tests
  python3-pytest    # the Python binding's tests run with /usr/bin/python3 -m pytest
  python3-zmq       # bench/python/bench_py.py: pyzmq REQ/REP and DEALER beside Spindle's Python calls
  openssh-client    # Runtime::ssh() runs the real ssh; the tests make keys with ssh-keygen
  openssh-server    # tests/test_ssh.cpp and bench_ssh start a throwaway sshd on 127.0.0.1
)

missing=()
for pkg in "${PACKAGES[@]}"; do
  status="$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)"
  if [[ "$status" != "install ok installed" ]]; then
    missing+=("$pkg")
  fi
done

if [[ ${#missing[@]} -eq 0 ]]; then
  echo "setup: all required packages are installed"
  exit 0
fi

echo "setup: missing packages: ${missing[*]}"

if [[ "$(id -u)" -ne 0 ]]; then
  echo "setup: error: not running as root, cannot install packages." >&2
  echo "setup: run:  sudo apt-get update && sudo apt-get install -y ${missing[*]}" >&2
  exit 1
fi

export DEBIAN_FRONTEND=noninteractive
apt-get update
apt-get install -y --no-install-recommends "${missing[@]}"
echo "setup: installed: ${missing[*]}"
