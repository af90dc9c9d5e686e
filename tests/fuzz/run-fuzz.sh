#!/bin/bash
# Builds the libFuzzer targets with clang (ASan + UBSan + fuzzer coverage) and
# runs each one for a while from seeds made by make_seeds.py.
#
#   tests/fuzz/run-fuzz.sh [--build-dir DIR] [--seconds N] [--jobs J] [--targets-at-once T] [TARGET...]
#
# Defaults: DIR=build-fuzz in the repository, N=15 per target, J=1 (libFuzzer
# -fork=J: J processes fuzz one target), T=1 (targets fuzzed side by side, each
# still for N seconds in one process: T=2 on two CPUs halves the wall time and
# gives each target the CPU time it has alone), all targets. Crashing inputs
# are kept in DIR/artifacts/; the run fails if any target crashes or finds a
# sanitizer error. Corpora grow in DIR/corpus/ and
# are reused by later runs. Exit status: 0 clean, 1 a finding, 2 set-up error.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
build="$repo/build-fuzz"
seconds=15
jobs=1
at_once=1
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --build-dir) build=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    --targets-at-once) at_once=$2; shift 2 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) targets+=("$1"); shift ;;
  esac
done
if [ ${#targets[@]} -eq 0 ]; then
  # Every fuzz_*.cc but the per-format template, and fuzz_FMT for each format
  # tests/fuzz/CMakeLists.txt lists (the one list of them).
  for src in "$here"/fuzz_*.cc; do
    t=$(basename "$src" .cc)
    [ "$t" = fuzz_format ] || targets+=("$t")
  done
  for fmt in $(sed -n 's/^set(QCOWFS_FUZZ_FORMATS \(.*\))$/\1/p' "$here/CMakeLists.txt"); do
    targets+=("fuzz_$fmt")
  done
fi

fail() { echo "run-fuzz: $*" >&2; exit 2; }
command -v clang++ >/dev/null || fail "clang++ not found: run tests/setup-deps.sh (installs clang and libclang-rt)"
rt=$(clang++ -print-file-name=libclang_rt.fuzzer-x86_64.a 2>/dev/null || true)
[ -f "$rt" ] || rt=$(find /usr/lib/llvm-*/lib/clang -name 'libclang_rt.fuzzer-x86_64.a' 2>/dev/null | head -1)
[ -n "$rt" ] && [ -f "$rt" ] || fail "libFuzzer runtime missing: apt-get install libclang-rt-14-dev (tests/setup-deps.sh)"
command -v qemu-img >/dev/null || fail "qemu-img not found (needed for seeds)"

# -fno-sanitize=function: clang 14 fails on coroutines with it plus sancov
# ("Cannot represent a difference across sections").
flags="-O1 -gline-tables-only -fsanitize=fuzzer-no-link,address,undefined -fno-sanitize=function -fno-sanitize-recover=all -fno-omit-frame-pointer"
mkdir -p "$build"
if [ ! -f "$build/CMakeCache.txt" ]; then
  CC=clang CXX=clang++ cmake -S "$repo" -B "$build" -DQCOWFS_FUZZ=ON -DQCOWFS_WERROR=OFF \
    -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" \
    -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" >"$build/configure.log" 2>&1 \
    || { cat "$build/configure.log"; fail "configuring the clang build failed"; }
fi
cmake --build "$build" -j2 --target "${targets[@]}" >"$build/build.log" 2>&1 \
  || { tail -40 "$build/build.log"; fail "building the fuzz targets failed"; }

seeds="$build/seeds"
[ -d "$seeds/vmdk" ] && [ -d "$seeds/luks1" ] && [ -d "$seeds/luks_header" ] && [ -d "$seeds/fuse_message" ] || PYTHONPATH="$here/..${PYTHONPATH:+:$PYTHONPATH}" python3 "$here/make_seeds.py" "$seeds" || fail "making seeds failed"
mkdir -p "$build/artifacts"

export ASAN_OPTIONS="abort_on_error=1:detect_leaks=1:allocator_may_return_null=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"

# Fuzzes target $1 for $seconds; its log is $build/$1.log, and $build/$1.report
# gets what to print about it (written whole at the end, so targets fuzzed side
# by side do not interleave their lines).
fuzz_one() {
  local t=$1 kind=${1#fuzz_} report="$build/$1.report"
  local corpus="$build/corpus/$t"
  mkdir -p "$corpus"
  # Inputs as long as the longest seed (VHDX keeps its metadata megabytes in).
  local max_len=131072 seed n
  for seed in "$seeds/$kind"/*; do
    n=$(stat -c %s "$seed")
    [ "$n" -le "$max_len" ] || max_len=$n
  done
  local parallel=()
  [ "$jobs" -gt 1 ] && parallel=(-fork="$jobs")
  if ! (cd "$build" && "$build/tests/fuzz/$t" "$corpus" "$seeds/$kind" -max_total_time="$seconds" -timeout=10 \
      -rss_limit_mb=2048 -max_len="$max_len" "${parallel[@]}" -print_final_stats=1 \
      -artifact_prefix="$build/artifacts/$t-" >"$build/$t.log" 2>&1); then
    { echo "== $t: ${seconds}s"
      echo "!! $t found a problem; log: $build/$t.log; inputs: $build/artifacts/"
      grep -E "ERROR|SUMMARY|invariant|Test unit written" "$build/$t.log" | head -20 || true
    } >"$report.tmp"
    mv "$report.tmp" "$report"
    return 1
  fi
  { echo "== $t: ${seconds}s"
    grep -E "stat::number_of_executed_units|stat::peak_rss_mb" "$build/$t.log" | tr '\n' ' ' || true
    echo
  } >"$report.tmp"
  mv "$report.tmp" "$report"
}

status=0
running=0
for t in "${targets[@]}"; do
  rm -f "$build/$t.report"
  if [ "$running" -ge "$at_once" ]; then
    wait -n || status=1
    running=$((running - 1))
  fi
  fuzz_one "$t" &
  running=$((running + 1))
done
while [ "$running" -gt 0 ]; do
  wait -n || status=1
  running=$((running - 1))
done
for t in "${targets[@]}"; do
  if [ -f "$build/$t.report" ]; then
    cat "$build/$t.report"
  else
    echo "!! $t: no report (the run did not finish)"
    status=1
  fi
done
exit $status
