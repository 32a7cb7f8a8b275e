#!/bin/bash
# Installs the build tree into a temporary prefix, then checks what a user
# gets there:
#  - only public headers, each compiling on its own;
#  - the umbrella header reaching no Asio, spdlog or Boost header;
#  - pkg-config's flags carrying no -DASIO_*;
#  - tests/consumer configured with find_package(spindle COMPONENTS asio),
#    built and run; and its second program, with the boost_asio and spdlog
#    components.
# Usage: run.sh <build dir> <source dir> <c++ compiler>
set -euo pipefail
build=$1 src=$2 cxx=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix

cmake --install "$build" --prefix "$prefix" > "$tmp/install.log"
inc=$prefix/include

echo "== installed headers"
bad=$(find "$inc/spindle" -type f ! -name '*.h' -o -type d -mindepth 1 -path "$inc/spindle/*" | head -5)
[ -z "$bad" ] || { echo "not a flat set of public headers: $bad"; exit 1; }
for h in "$inc"/spindle/*.h; do
  name=spindle/$(basename "$h")
  if grep -nE '#include +"' "$h"; then echo "$name: includes a quoted (non-<spindle/...>) path"; exit 1; fi
  if grep -nE '#include +<(broker|stream|router|services|shm)/' "$h"; then echo "$name: includes an internal header"; exit 1; fi
  echo "#include <$name>" | "$cxx" -std=c++20 -fsyntax-only -DASIO_STANDALONE -I"$inc" -x c++ - \
    || { echo "$name does not compile on its own"; exit 1; }
  echo "ok   $name compiles on its own"
done

echo "== the umbrella header's includes"
deps=$(echo '#include <spindle/spindle.h>' | "$cxx" -std=c++20 -M -I"$inc" -x c++ -)
if echo "$deps" | tr ' ' '\n' | grep -E '/(asio|spdlog|boost|fmt)(/|\.h)'; then
  echo "<spindle/spindle.h> reaches the headers above"; exit 1
fi
echo "ok   <spindle/spindle.h> reaches no asio, spdlog, fmt or boost header"

echo "== pkg-config"
cflags=$(PKG_CONFIG_PATH=$(dirname "$(find "$prefix" -name spindle.pc)") pkg-config --cflags spindle)
echo "cflags: $cflags"
if echo "$cflags" | grep -q -- '-DASIO'; then echo "spindle.pc forces -DASIO_* on its users"; exit 1; fi

echo "== an out-of-tree consumer"
cmake -S "$src/tests/consumer" -B "$tmp/consumer" -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_CXX_COMPILER="$cxx" > "$tmp/configure.log" || { cat "$tmp/configure.log"; exit 1; }
cmake --build "$tmp/consumer" -j2 > "$tmp/build.log" 2>&1 || { cat "$tmp/build.log"; exit 1; }
"$tmp/consumer/consumer"
"$tmp/consumer/consumer_boost_spdlog"
