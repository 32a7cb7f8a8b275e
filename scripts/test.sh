#!/usr/bin/env bash
# Build and run the whole Spindle test suite in several flavours:
#   plain  RelWithDebInfo                      -> build-plain/
#   asan   ASan + UBSan (-O1 -g1, no benches)   -> build-asan/
#   tsan   TSan         (-O1 -g1, no benches)   -> build-tsan/
#   fuzz   every libFuzzer target for 20 s     -> build-fuzz/ (scripts/fuzz.sh)
# The builds use -g1 (line tables): reports keep file:line, and the builds
# are much lighter, which keeps .ci/run under its 30 minutes. So does
# compiling the test binary's own code at -O0 in the plain and asan flavours
# (SPINDLE_UNOPTIMIZED_TESTS; the library stays optimized): measured on 2
# cores, the asan flavour's build fell by about 100 s and its tests took 27 s
# longer; plain's build fell by 43 s, its tests 4 s longer. TSan's -O1 build
# is cheap already (18 s less CPU at -O0, tests 14 s longer), so it keeps the
# test code optimized, and with it the one run of the inline public headers
# compiled into the tests with optimization.
# The asan flavour links its executables non-PIE (CMakeLists.txt: every
# process started 0.18 s sooner, its tests 335 -> 261 s on a slow guest),
# and the sanitized flavours skip ForksScaling.N512 (33-40 s each), which the
# plain flavour runs.
# Choose flavours with SPINDLE_FLAVOURS (default "plain asan tsan fuzz"),
# e.g. SPINDLE_FLAVOURS=plain bash scripts/test.sh
# Stops at the first flavour that fails and exits non-zero.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh

read -r -a FLAVOURS <<< "${SPINDLE_FLAVOURS:-plain asan tsan fuzz}"
JOBS="${SPINDLE_JOBS:-2}"

# Any sanitizer report must fail the test that produced it.
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
# die_after_fork=0: a forked child builds its own broker thread, which is the
# design (see docs/DESIGN.md, Fork safety). TSan's default kills such a child
# because other threads might have held locks at the fork; fork_child() parks
# the broker thread for the instant of the fork so none are held.
# atexit_sleep_ms=50: TSan sleeps 1 s in every exiting process by default (to
# let other threads report); the tests start hundreds of processes.
# scripts/tsan.supp holds one documented suppression (exception_ptr's
# reference count lives in the uninstrumented libstdc++).
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:die_after_fork=0:atexit_sleep_ms=50:suppressions=$PWD/scripts/tsan.supp"
# The ssh tests (tests/test_ssh.cpp) skip when sshd cannot start; CI must
# run them, so here they fail instead of skipping.
export SPINDLE_REQUIRE_SSHD=1

for f in "${FLAVOURS[@]}"; do
  case "$f" in
    plain|asan|tsan|fuzz) ;;
    *) echo "test: unknown flavour '$f' (expected plain, asan, tsan or fuzz)" >&2
       exit 2 ;;
  esac
done

banner() {
  echo
  echo "=================================================================="
  echo "== $*"
  echo "=================================================================="
}

# TSan in older GCCs cannot cope with the high mmap entropy of some newer
# kernels ("unexpected memory mapping"). If a trivial TSan program fails,
# run that flavour's build and tests with ASLR disabled.
tsan_wrapper() {
  local dir
  dir="$(mktemp -d)"
  printf '#include <thread>\nint main(){int x=0;std::thread t([&]{x=1;});t.join();return x-1;}\n' \
    > "$dir/probe.cpp"
  if ! c++ -std=c++20 -fsanitize=thread -g "$dir/probe.cpp" -o "$dir/probe" \
       >/dev/null 2>&1; then
    rm -rf "$dir"; return 0   # let the real build report the problem
  fi
  if ! "$dir/probe" >/dev/null 2>&1 \
     && setarch "$(uname -m)" -R "$dir/probe" >/dev/null 2>&1; then
    echo "setarch $(uname -m) -R"
  fi
  rm -rf "$dir"
}

# Ninja keeps both cores busy across target boundaries (the tests' unity
# batches compile while the library's last batch does). A build directory
# configured earlier keeps the generator it has: CMake refuses to switch.
generator_args() {
  if command -v ninja >/dev/null 2>&1 && [[ ! -f "$1/CMakeCache.txt" ]]; then
    echo "-G Ninja"
  fi
}

declare -A RESULT=()
declare -A ELAPSED=()
declare -A COUNTS=()
total_passed=0
total_failed=0
failed_flavour=""

for flavour in "${FLAVOURS[@]}"; do
  builddir="build-$flavour"
  # Unity batches: the suite's builds take most of its time (see
  # SPINDLE_UNITY_BUILD in CMakeLists.txt).
  args=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DSPINDLE_UNITY_BUILD=ON
        -DSPINDLE_SANITIZE_ADDRESS=OFF -DSPINDLE_SANITIZE_THREAD=OFF
        -DSPINDLE_UNOPTIMIZED_TESTS=OFF)
  read -r -a generator <<< "$(generator_args "$builddir")"
  args+=("${generator[@]}")
  wrapper=()
  case "$flavour" in
    plain)
      # -g1 (line tables, no variable locations): backtraces keep their file
      # and line, and the build takes a quarter less time than with -g.
      # SPINDLE_PYTHON=ON: without pybind11 or Python's headers the build
      # fails, rather than leaving the Python tests out of the run.
      args+=(-DSPINDLE_BUILD_BENCH=ON "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG"
             -DSPINDLE_UNOPTIMIZED_TESTS=ON -DSPINDLE_PYTHON=ON) ;;
    asan)
      args+=(-DSPINDLE_SANITIZE_ADDRESS=ON -DSPINDLE_BUILD_BENCH=OFF -DSPINDLE_UNOPTIMIZED_TESTS=ON
             "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1") ;;
    tsan)
      args+=(-DSPINDLE_SANITIZE_THREAD=ON -DSPINDLE_BUILD_BENCH=OFF
             "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1")
      read -r -a wrapper <<< "$(tsan_wrapper)"
      if [[ ${#wrapper[@]} -gt 0 ]]; then
        echo "test: TSan needs ASLR off on this kernel; using: ${wrapper[*]}"
      fi ;;
  esac

  banner "flavour: $flavour  (dir: $builddir)"
  start=$SECONDS
  status=0
  stage=""

  if [[ "$flavour" == fuzz ]]; then
    # Builds with clang and runs each target for a short fixed time; any
    # crash, leak, hang or sanitizer report fails it (see scripts/fuzz.sh).
    stage=fuzz
    if bash scripts/fuzz.sh; then COUNTS[$flavour]="every target ran clean"; else status=1; fi
  else
  stage=configure
  if cmake -S . -B "$builddir" "${args[@]}"; then
    stage=build
    if "${wrapper[@]}" cmake --build "$builddir" -j"$JOBS"; then
      stage="test"
      log="$builddir/ctest.log"
      if ! "${wrapper[@]}" ctest --test-dir "$builddir" --output-on-failure \
             -j"$JOBS" --timeout 300 --no-tests=error 2>&1 | tee "$log"; then
        status=1
      fi
      line="$(grep -E '[0-9]+% tests passed, [0-9]+ tests? failed out of [0-9]+' \
                "$log" | tail -n1 || true)"
      if [[ "$line" =~ ([0-9]+)\ tests?\ failed\ out\ of\ ([0-9]+) ]]; then
        nfail="${BASH_REMATCH[1]}"
        ntotal="${BASH_REMATCH[2]}"
        COUNTS[$flavour]="$((ntotal - nfail))/$ntotal tests passed"
        total_passed=$((total_passed + ntotal - nfail))
        total_failed=$((total_failed + nfail))
      elif [[ $status -ne 0 ]]; then
        total_failed=$((total_failed + 1))
      fi
    else
      status=1
    fi
  else
    status=1
  fi
  fi

  ELAPSED[$flavour]=$((SECONDS - start))
  if [[ $status -eq 0 ]]; then
    RESULT[$flavour]="PASS"
    banner "flavour $flavour: PASS in ${ELAPSED[$flavour]} s"
  else
    RESULT[$flavour]="FAIL ($stage)"
    banner "flavour $flavour: FAILED at $stage after ${ELAPSED[$flavour]} s"
    failed_flavour="$flavour"
    break
  fi
done

echo
echo "Summary:"
for flavour in "${FLAVOURS[@]}"; do
  if [[ -n "${RESULT[$flavour]:-}" ]]; then
    printf '  %-6s %-16s %5s s  %s\n' "$flavour" "${RESULT[$flavour]}" \
      "${ELAPSED[$flavour]}" "${COUNTS[$flavour]:-}"
  else
    printf '  %-6s %-16s %5s    (not run: stopped after %s failed)\n' \
      "$flavour" "SKIPPED" "-" "$failed_flavour"
  fi
done

if [[ -n "$failed_flavour" ]]; then
  echo "test: flavour '$failed_flavour' failed; see output above" >&2
  echo "total: $total_passed passed, $total_failed failed"
  exit 1
fi
echo "total: $total_passed passed, $total_failed failed"
