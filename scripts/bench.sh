#!/usr/bin/env bash
# Run every benchmark (bench/*.cpp -> bench_<name>) and print one table of
# their rows: name, value, unit, the floor measured in the same run, and
# value / floor. Each bench also writes its rows as JSON (bench/report.h).
#
#   scripts/bench.sh [--quick] [--json DIR]
#
# --quick     each bench's short run (a minute or so in all)
# --json DIR  keep DIR/bench_<name>.json, DIR/bench_<name>.log and
#             DIR/all.json (every row); without it they go to a temporary
#             directory that is removed at the end
#
# Build: the Release build in $SPINDLE_BUILD_DIR when set (its bench targets
# are brought up to date there), otherwise one configured and built in
# build-bench/ (Release, -DSPINDLE_BUILD_BENCH=ON, no tests).
#
# Exits non-zero if a bench fails (a wrong reply, a lost message, a failed
# syscall); the figures themselves never fail it. The machine's other load
# skews every row: the load average is printed before and after.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

usage() {
  echo "usage: scripts/bench.sh [--quick] [--json DIR]" >&2
  exit 2
}

QUICK=()
JSON_DIR=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --quick) QUICK=(--quick); shift ;;
    --json)
      [[ $# -ge 2 && -n "$2" ]] || usage
      JSON_DIR="$2"; shift 2 ;;
    -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) usage ;;
  esac
done

command -v python3 >/dev/null || { echo "bench: python3 is needed for the table" >&2; exit 1; }

BENCHES=()
for src in bench/*.cpp; do
  name="$(basename "$src" .cpp)"
  case "$name" in
    report|alloc_count) continue ;;   # linked into every bench, not programs
  esac
  [[ "$name" == bench* ]] || name="bench_$name"
  BENCHES+=("$name")
done

if [[ -n "${SPINDLE_BUILD_DIR:-}" ]]; then
  BUILD="$SPINDLE_BUILD_DIR"
  [[ -f "$BUILD/CMakeCache.txt" ]] || { echo "bench: $BUILD is not a CMake build directory" >&2; exit 1; }
  type="$(sed -n 's/^CMAKE_BUILD_TYPE:[A-Z]*=//p' "$BUILD/CMakeCache.txt")"
  [[ "$type" == "Release" ]] ||
    echo "bench: warning: $BUILD is a '${type:-unset}' build, not Release: figures are not comparable" >&2
else
  BUILD="build-bench"
  bash scripts/setup.sh
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DSPINDLE_BUILD_BENCH=ON -DBUILD_TESTING=OFF >/dev/null
fi
echo "bench: building ${BENCHES[*]} in $BUILD"
cmake --build "$BUILD" -j"${SPINDLE_JOBS:-2}" --target "${BENCHES[@]}" spindle-router >/dev/null

if [[ -n "$JSON_DIR" ]]; then
  mkdir -p "$JSON_DIR"
  OUT="$(cd "$JSON_DIR" && pwd)"
else
  OUT="$(mktemp -d /tmp/spindle-bench-XXXXXX)"
  trap 'rm -rf "$OUT"' EXIT
fi

echo "bench: $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg) at start" \
     "(other load skews every row)"
failed=()
for b in "${BENCHES[@]}"; do
  extra=()
  [[ "$b" == bench_forks ]] && extra=(--svg "$OUT/bench_forks.svg")
  rm -f "$OUT/$b.json"   # a stale file must not stand in for a failed run
  start=$(date +%s%N)
  printf 'bench: %-16s ' "$b"
  if "$BUILD/$b" "${QUICK[@]}" "${extra[@]}" --json "$OUT/$b.json" >"$OUT/$b.log" 2>&1; then
    ms=$(( ($(date +%s%N) - start) / 1000000 ))
    printf 'ok   %4d.%01d s\n' $((ms / 1000)) $((ms % 1000 / 100))
  else
    rc=$?
    printf 'FAILED (exit %d), the end of its output:\n' "$rc"
    tail -n 20 "$OUT/$b.log" | sed 's/^/    /'
    failed+=("$b")
  fi
done
echo "bench: load average $(cut -d' ' -f1-3 /proc/loadavg) at end"

python3 - "$OUT" "${BENCHES[@]}" <<'EOF'
import json, math, os, sys

out, benches = sys.argv[1], sys.argv[2:]

def num(v):
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return ""
    a = abs(v)
    if a >= 1000 or (v == math.floor(v) and a < 1e15):  # counts
        return f"{v:.0f}"
    decimals = min(max(3 - math.floor(math.log10(a)), 0), 6)
    return f"{v:.{decimals}f}"

def ratio(r):
    if r is None:
        return ""
    return (f"{r:.2f}" if abs(r) >= 0.1 or r == 0 else num(r)) + "x"

groups, everything, seen = [], [], {}
for b in benches:
    path = os.path.join(out, b + ".json")
    if not os.path.exists(path):
        continue
    with open(path) as f:
        rows = json.load(f)["rows"]
    for r in rows:
        if r["name"] in seen:
            print(f"bench: warning: row {r['name']} from {b} also in {seen[r['name']]}", file=sys.stderr)
        seen[r["name"]] = b
    groups.append((b, rows))
    everything.extend(rows)

with open(os.path.join(out, "all.json"), "w") as f:
    json.dump({"rows": everything}, f, indent=1)
    f.write("\n")

head = ("row", "value", "unit", "floor (same run)", "ratio")
cells = [(r["name"], num(r["value"]), r["unit"], num(r["floor"]), ratio(r["ratio"])) for r in everything]
w = [max([len(head[i])] + [len(c[i]) for c in cells]) for i in range(5)]
rule = "-" * (sum(w) + 8)

def line(c):
    print(f"{c[0]:<{w[0]}}  {c[1]:>{w[1]}}  {c[2]:<{w[2]}}  {c[3]:>{w[3]}}  {c[4]:>{w[4]}}".rstrip())

print()
print(rule)
line(head)
for b, rows in groups:
    print(rule)
    print(b)
    for r in rows:
        line((r["name"], num(r["value"]), r["unit"], num(r["floor"]), ratio(r["ratio"])))
print(rule)
EOF

if [[ -n "$JSON_DIR" ]]; then
  echo "bench: rows in $OUT/all.json; each bench's JSON and output in $OUT/bench_<name>.{json,log}"
fi
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "bench: FAILED: ${failed[*]}" >&2
  exit 1
fi
