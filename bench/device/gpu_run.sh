#!/usr/bin/env bash
# The GPU checks, after `source bench/device/mlx_cuda.sh install` in the same shell:
#
#   source bench/device/mlx_cuda.sh install || exit 1; bash bench/device/gpu_run.sh [PART...]
#
# PARTs (default: all, in this order): pytest, attn, ce, compare, context. Each runs under its own
# time limit (seconds; SCALE multiplies them all) and writes its log into $OUT, so that the parts
# that finished come back even when a later one is cut off. All five take about 13 minutes on an
# H200: more than one call, so name the parts of each call.
OUT=${OUT:-/tmp/gpu-run}
SCALE=${SCALE:-1}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

part() {
  local name=$1 limit=$2 start rc
  shift 2
  limit=$(python3 -c "print(int($limit * $SCALE))")
  echo "== $name (limit ${limit} s): $*"
  start=$(date +%s)
  timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "== $name: exit $rc after $(($(date +%s) - start)) s"
  tail -n 30 "$OUT/$name.log" | cut -c1-400
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
for p in "${@:-pytest attn ce compare context}"; do
  for p in $p; do
    case $p in
    pytest) part pytest 150 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_kernel_gpu.py ;;
    # attention: every tier and MLX's fused attention, packed rows and head dim 64 included
    attn) part attn 170 python3 bench/kernels.py --gpu --only attn --budget 130 \
      --jsonl "$OUT/attn.jsonl" ;;
    # the loss under a 24 GB memory limit (peaks are then what each tier needs), with larger chunks
    ce) part ce 170 python3 bench/kernels.py --gpu --only ce --budget 130 --memory-limit-gb 24 \
      --chunk-elements 16777216 67108864 --jsonl "$OUT/ce.jsonl" ;;
    compare) part compare 240 python3 bench/compare_mlx_lm.py --quick --model 1b --dtype bfloat16 \
      --workload text-fixed --vocab 32768 ;;
    context) part context 240 python3 bench/context_length.py --model 1b --dtype bfloat16 \
      --budget-gb 24 --start 8192 --stop 131072 --budget-s 100 --attention auto \
      --settings mlxtune+ckpt mlx-lm+ckpt ;;
    *) echo "unknown part $p (pytest, attn, ce, compare, context)" >&2 ;;
    esac
  done
done
