#!/usr/bin/env bash
# Build the libFuzzer targets (fuzz/fuzz_*.cpp, clang, ASan+UBSan) in
# build-fuzz/ and run each from its seed corpus (fuzz/corpus/<target>/).
#   scripts/fuzz.sh                  every target for 20 s (the CI run),
#                                    SPINDLE_JOBS (2) targets at a time
#   scripts/fuzz.sh --long [SECONDS] every target for 10 M execs or SECONDS
#                                    (default 3600), whichever comes first
#   scripts/fuzz.sh [...] TARGET...  only these targets (e.g. fuzz_parser)
# New inputs go to build-fuzz/corpus/<target>/ (not into the repo); a crash
# leaves its input in build-fuzz/artifacts/ and fails the run. Prints the exec
# count each target reached (libFuzzer's final stats) and exits non-zero if
# any target crashed, leaked, timed out or ran out of memory.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

seconds="${SPINDLE_FUZZ_SECONDS:-20}"
runs=-1  # libFuzzer's "no limit"
if [[ "${1:-}" == "--long" ]]; then
  shift
  seconds=3600
  runs=10000000
  if [[ "${1:-}" =~ ^[0-9]+$ ]]; then seconds="$1"; shift; fi
fi

bash scripts/setup.sh

builddir=build-fuzz
targets=("$@")
if [[ ${#targets[@]} -eq 0 ]]; then
  for src in fuzz/fuzz_*.cpp; do targets+=("$(basename "$src" .cpp)"); done
fi

generator=()
if command -v ninja >/dev/null 2>&1 && [[ ! -f "$builddir/CMakeCache.txt" ]]; then
  generator=(-G Ninja)
fi
cmake -S . -B "$builddir" "${generator[@]}" -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSPINDLE_UNITY_BUILD=ON \
  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1" -DSPINDLE_BUILD_FUZZERS=ON \
  -DBUILD_TESTING=OFF -DSPINDLE_BUILD_BENCH=OFF >/dev/null
cmake --build "$builddir" -j"${SPINDLE_JOBS:-2}" --target "${targets[@]}"

export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"

# One target per core at a time: each libFuzzer run is single-threaded.
run_target() {
  local t="$1" corpus="$builddir/corpus/$1" log="$builddir/$1.log"
  mkdir -p "$corpus" "$builddir/artifacts"
  echo "fuzz: $t for ${seconds} s"
  # -max_len bounds one input; -timeout flags a hang; -rss_limit_mb a blow-up.
  if "$builddir/fuzz/$t" -max_total_time="$seconds" -runs="$runs" -max_len=4096 -timeout=60 \
       -rss_limit_mb=2560 -print_final_stats=1 -artifact_prefix="$builddir/artifacts/$t-" \
       "$corpus" "fuzz/corpus/$t" >"$log" 2>&1; then
    echo ok >"$builddir/$t.status"
  else
    echo FAILED >"$builddir/$t.status"
  fi
}

parallel="${SPINDLE_JOBS:-2}"
for t in "${targets[@]}"; do
  rm -f "$builddir/$t.status"
  while [[ $(jobs -rp | wc -l) -ge $parallel ]]; do wait -n || true; done
  run_target "$t" &
done
wait

declare -A EXECS=() STATUS=()
failed=0
for t in "${targets[@]}"; do
  STATUS[$t]="$(cat "$builddir/$t.status" 2>/dev/null || echo FAILED)"
  if [[ "${STATUS[$t]}" != ok ]]; then
    failed=1
    echo "fuzz: $t failed; the end of its log:" >&2
    tail -n 60 "$builddir/$t.log" >&2
  fi
  EXECS[$t]="$(grep -oE 'stat::number_of_executed_units: *[0-9]+' "$builddir/$t.log" | grep -oE '[0-9]+$' || echo '?')"
done

echo
limit="${seconds} s"
[[ $runs -gt 0 ]] && limit="$runs execs or ${seconds} s"
echo "Fuzzing summary (each target: $limit):"
for t in "${targets[@]}"; do
  took="$(grep -oE 'Done [0-9]+ runs in [0-9]+ second' "$builddir/$t.log" | grep -oE '[0-9]+ second' || echo '? second')"
  printf '  %-16s %-7s %12s execs in %ss\n' "$t" "${STATUS[$t]}" "${EXECS[$t]}" "${took% second}"
done
exit "$failed"
