#!/usr/bin/env bash
# Everything a change must pass on a GPU, in one device call, each step under its own time limit so a
# slow step cannot take the others' time; logs under $OUT (default ./verify-out), a summary last.
#
#   OUT=/path bash scripts/verify_gpu.sh [steps...]      # steps: tests fuzz sanitize bench (default: all)
#                                                        # bench = host bwd decode variants (each a step too)
#   FUZZ_S=390 SANITIZE_S=240 ... bash scripts/verify_gpu.sh fuzz   # the slow steps' time limits (seconds)
#   TESTS="tests/gpu/test_backward_gpu.py ..."           # what the tests step runs (default: tests/gpu)
#   BWD_VARIANTS="k_unroll=1 deterministic=true"         # backward knob sets the bwd step times beside the default
#   WARM_FUZZ=0                                          # warm only the shipped kernels, not the fuzz's (no fuzz step)
#
# Order and isolation are deliberate (H200, 2026-12-03): the fuzz runs alone (a racecheck sharing the
# GPU starved it to a few hundred cases in three minutes); the sanitizer runs after it; the timings
# last, on an idle GPU. The kernels are compiled first in parallel processes (a fresh machine has
# an empty compile cache: one by one they took minutes).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-verify-out}"
mkdir -p "$OUT"
steps="${*:-tests fuzz sanitize bench}"
steps="${steps/bench/host bwd decode variants}"
for s in $steps; do
    case $s in tests|fuzz|sanitize|host|bwd|decode|variants) ;;
        *) echo "unknown step: $s (tests fuzz sanitize bench host bwd decode variants)"; exit 2 ;; esac
done
source scripts/gpu_steps.sh

timeout -k 15 150 python3 scripts/warm_cache.py --fuzz "${WARM_FUZZ:-12000}" > "$OUT/warm.log" 2>&1; echo "warm: exit $? after $(( $(date +%s) - start )) s" >> "$OUT/warm.log"
for s in $steps; do
    case $s in
        tests)
            step pytest "${TESTS_S:-300}" python3 -m pytest -q -rs -rf --durations=25 -n 8 ${TESTS:-tests/gpu} ;;
        fuzz)
            step fuzz "${FUZZ_S:-390}" python3 -m facodegen check --fuzz 12000 --seed 1 --family all ;;
        sanitize)
            step sanitize "${SANITIZE_S:-240}" python3 scripts/sanitize.py --out "$OUT/sanitize"
            step sanitize_decode "${SANITIZE_DECODE_S:-120}" python3 scripts/sanitize_decode.py --out "$OUT/sanitize-decode"
            step sanitize_varlen "${SANITIZE_VARLEN_S:-150}" python3 scripts/sanitize_varlen.py --out "$OUT/sanitize-varlen" ;;
        host)
            step host_cost 60 python3 scripts/host_cost_breakdown.py
            step overhead 60 python3 -m facodegen bench --suite overhead --out "$OUT" ;;
        bwd)
            variant_args=()
            for knobs in ${BWD_VARIANTS:-}; do variant_args+=(--variant "$knobs"); done
            step bench_backward "${BWD_S:-120}" python3 -m facodegen bench --suite fa3-paper --backward --quick \
                ${BWD_HEAD_DIM:+--head-dim $BWD_HEAD_DIM} "${variant_args[@]}" --out "$OUT" ;;
        decode)
            step bench_decode 180 python3 -m facodegen bench --suite decode --quick --out "$OUT" ;;
        variants)
            step bench_variants 90 python3 -m facodegen bench --suite variants --out "$OUT" ;;
    esac
done
print_summary verify_gpu.sh
