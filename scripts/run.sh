#!/usr/bin/env bash
# Build Spindle (RelWithDebInfo, into build/), then run the demos: the
# spindle-router program with three worker processes talking through it, and
# a parent with forked children. Exits non-zero if either demo fails.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh

cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build build -j2

echo "run: ./build/router_demo"
./build/router_demo
echo
echo "run: ./build/parent_child"
exec ./build/parent_child
