#!/usr/bin/env bash
# The imbalance and heterogeneity benchmarks on a 16-core machine: 4 ranks x 3 intra-op threads (12 cores),
# leaving cores for gloo's and the engines' communication threads, to set beside the 2-core figures
# (benchmarks/results/imbalance.json, heterogeneity.json: 4 single-thread ranks on 2 cores).
#
#   bash benchmarks/cores16.sh [OUT_DIR] [imbalance|heterogeneity|both]    # from the repository's root
#
# OUT_DIR (default /tmp) receives each benchmark's log, its JSON and PNG (also written to
# benchmarks/results/*_16core.*) and cores16_env.txt: at most 7 files. Each file is copied as soon as its
# benchmark ends, so a run cut short still leaves the first one's results. lightning_partial need not be
# installed (run from the repository's root, every benchmark and worker is a python -m module); matplotlib is optional.
#
# Settings against the 2-core runs: benchmarks.imbalance as there (every default configuration, 250 steps, 1 repeat,
# D = 2 x the calibrated concurrent step, now of 3-thread processes); benchmarks.heterogeneity as there except
# HET_REPEATS (default 2, the 2-core run had 3) so that both fit in about 8 minutes. Both: --threads 3
# (THREADS), --steal-retries 1 (2 by default) to bound the time a fit the hypervisor stole from can add.
# benchmarks.heterogeneity runs its default protocol (SGD momentum 0.9, abs_sgd at the strategy's defaults,
# the same samples); the heterogeneity_16core.json it replaces holds the earlier plain-SGD protocol's (docs/benchmarks.md).
# Measured on the H100 machine's 16 cores: about 45 s per fit (start-up, 250 steps, evaluation), so
# every configuration does not fit in one 10-minute device call: IMB_ONLY picks a subset, HET_REPEATS
# the heterogeneity repeats, STEAL_RETRIES the reruns of a fit the hypervisor stole from.
# Environment: PYTHON (default python3), THREADS, HET_REPEATS, IMB_REPEATS (default 1), STEAL_RETRIES, IMB_ONLY.
set -euo pipefail

OUT_DIR="${1:-/tmp}"
WHICH="${2:-both}"
PYTHON="${PYTHON:-python3}"
THREADS="${THREADS:-3}"
HET_REPEATS="${HET_REPEATS:-2}"
STEAL_RETRIES="${STEAL_RETRIES:-1}"
IMB_ONLY="${IMB_ONLY:-}"  # a comma-separated subset of benchmarks.imbalance's configurations (default: all)
IMB_REPEATS="${IMB_REPEATS:-1}"
export PYTHONUNBUFFERED=1

case "$WHICH" in
  imbalance|heterogeneity|both) ;;
  *) echo "usage: bash benchmarks/cores16.sh [OUT_DIR] [imbalance|heterogeneity|both]" >&2; exit 2 ;;
esac
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
cd "$(dirname "${BASH_SOURCE[0]}")/.."  # the repository's root
RESULTS=benchmarks/results
mkdir -p "$RESULTS"

{
  echo "date: $(date -u +%FT%TZ)"
  echo "host: $(uname -a)"
  echo "nproc: $(nproc)"
  grep -m1 'model name' /proc/cpuinfo || true
  echo "load average: $(cat /proc/loadavg)"
  echo "git: $(git rev-parse HEAD 2>/dev/null || echo unknown) $(git status --porcelain 2>/dev/null | wc -l) changed paths"
  "$PYTHON" -c 'import sys, torch, lightning; print("python", sys.version.split()[0], "torch", torch.__version__, "lightning", lightning.__version__, "threads", torch.get_num_threads())' || true
  echo "THREADS=$THREADS HET_REPEATS=$HET_REPEATS IMB_REPEATS=$IMB_REPEATS STEAL_RETRIES=$STEAL_RETRIES IMB_ONLY=$IMB_ONLY"
} > "$OUT_DIR/cores16_env.txt" 2>&1
cat "$OUT_DIR/cores16_env.txt"

failed=0
run() {  # run NAME ARGS...: one benchmark, logged to OUT_DIR/NAME_16core.log; its results copied to OUT_DIR
  local name="$1"; shift
  local log="$OUT_DIR/${name}_16core.log" start=$SECONDS status=0
  rm -f "$RESULTS/${name}_16core.json" "$RESULTS/${name}_16core.png"  # never copy an earlier run's
  echo "=== $name: $*" | tee "$log"
  "$PYTHON" -m "benchmarks.$name" "$@" --threads "$THREADS" --steal-retries "$STEAL_RETRIES" \
    --out "$RESULTS/${name}_16core.json" 2>&1 | tee -a "$log" || status=$?
  echo "=== $name: exit $status after $((SECONDS - start)) s" | tee -a "$log"
  for f in "$RESULTS/${name}_16core.json" "$RESULTS/${name}_16core.png"; do
    if [[ -f "$f" ]]; then cp "$f" "$OUT_DIR/"; fi
  done
  if [[ $status -ne 0 ]]; then failed=1; fi
  return 0  # the other benchmark still runs
}

if [[ "$WHICH" != heterogeneity ]]; then
  # Per-fit time-out 150 s (fits take ~20 s here): a hung fit cannot eat the whole run.
  run imbalance --timeout 150 --repeats "$IMB_REPEATS" ${IMB_ONLY:+--only "$IMB_ONLY"}
fi
if [[ "$WHICH" != imbalance ]]; then
  run heterogeneity --repeats "$HET_REPEATS" --workdir /tmp/lightning_partial_heterogeneity_16core
fi
echo "total: $SECONDS s; files in $OUT_DIR:"
ls -l "$OUT_DIR"/cores16_env.txt "$OUT_DIR"/*_16core.* 2>/dev/null || true
exit "$failed"
