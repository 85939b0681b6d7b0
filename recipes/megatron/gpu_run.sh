#!/usr/bin/env bash
# Megatron-core GPT on the 2-GPU box: recipes/megatron/gpu_1p1.yaml over hetccl (the two GPUs
# emulate two vendors, so data parallelism crosses hetccl's bridge) and over plain NCCL
# (reference, same layout and data). Writes one JSON row per step to $OUT/megatron_gpu.jsonl
# and prints a comparison (step time, losses).
#
#   bash recipes/megatron/gpu_run.sh            # from the repository root
#   STEPS=40 OUT=/tmp/out bash recipes/megatron/gpu_run.sh
#
# The box has Python 3.12, torch 2.11, 2 GPUs, no internet and no megatron-core: megatron-core
# comes from the wheels in .whl/ (0.19.2 needs triton, which torch's CUDA wheels bring; without
# triton 0.16.1 is used). hetccl is built here if it is not importable (REBUILD=1 forces it).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out}
STEPS=${STEPS:-40}
RECIPE=recipes/megatron/gpu_1p1.yaml
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0           # keep NVLink SHARP off (see KINDS.md)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export PYTHONUNBUFFERED=1

echo "== python $(python -V 2>&1), torch $(python -c 'import torch; print(torch.__version__, torch.cuda.device_count(), "GPUs")')"

if ! python -c "import megatron.core" >/dev/null 2>&1; then
    if python -c "import triton" >/dev/null 2>&1; then MCORE=0.19.2; else MCORE=0.16.1; fi
    echo "== installing megatron-core $MCORE from .whl/"
    python -m pip install --no-index --no-deps --find-links .whl "megatron-core==$MCORE" 2>&1 | tail -2
fi
python -c "import megatron.core as m; print('== megatron-core', m.__version__)" 2>/dev/null

if [ "${REBUILD:-0}" = 1 ] || ! python -c "import hetccl.integrations.megatron" >/dev/null 2>&1; then
    echo "== building hetccl (pip install --no-build-isolation --no-deps .)"
    python -m pip install --no-build-isolation --no-deps . 2>&1 | tail -2
fi
python -c "import hetccl, torch.distributed as dist; print('== hetccl', hetccl.__version__, dist.Backend.HETCCL)"

ROWS="$OUT/megatron_gpu.jsonl"
rm -f "$ROWS"
for BACKEND in hetccl nccl; do
    echo "== training $RECIPE over $BACKEND ($STEPS steps)"
    torchrun --standalone --nproc_per_node 2 -m hetccl.integrations.megatron \
        --config "$RECIPE" --steps "$STEPS" --backend "$BACKEND" --emulate-vendors \
        --out "$ROWS" 2>&1 | grep -v -i "warn" | tee "$OUT/megatron_gpu_$BACKEND.log"
done

python - "$ROWS" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
by = {b: [r for r in rows if r["backend"] == b] for b in ("hetccl", "nccl")}
warm = 5
def med(b):
    return statistics.median(r["step_time_s"] for r in by[b][warm:]) * 1e3
h, n = by["hetccl"], by["nccl"]
diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(h, n))
print(f"\nmegatron-core GPT {h[0]['world']} GPUs (tp={h[0]['tp']}, dp={h[0]['dp']}, micro-batches per "
      f"dp rank {h[0]['micro_batches']}, global batch {h[0]['global_batch']}), {len(h)} steps")
print(f"{'backend':<8} {'median step ms':>15} {'first loss':>11} {'last loss':>10}")
for b in ("hetccl", "nccl"):
    print(f"{b:<8} {med(b):>15.1f} {by[b][0]['loss']:>11.4f} {by[b][-1]['loss']:>10.4f}")
print(f"hetccl / nccl step time: {med('hetccl') / med('nccl'):.2f}x; "
      f"max |loss difference| over steps: {diff:.2e}")
PY
