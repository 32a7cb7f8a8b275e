#!/usr/bin/env bash
# Build Spindle (RelWithDebInfo, into build/) and run the parent/child demo.
# Arguments are passed through to the demo; its exit code is ours.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh

cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build build -j2

echo "run: ./build/parent_child $*"
exec ./build/parent_child "$@"
