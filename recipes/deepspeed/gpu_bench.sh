#!/usr/bin/env bash
# DeepSpeed ZeRO-2/3 step time on the GPU box: plain NCCL vs hetccl with emulated 1+1 vendors.
#
# Expects: 2 GPUs, Python 3.12, torch 2.11, no internet, hetccl already built and installed
# (`pip install --no-build-isolation .`, the lead's script), DeepSpeed NOT installed. DeepSpeed
# 0.19.8 (pure Python, built with DS_BUILD_OPS=0) and its missing dependencies are installed
# from the repository's .whl/ folder, offline. The recipe uses torch's AdamW, so no DeepSpeed op
# is compiled.
#
# Run from anywhere:  OUT=/some/dir bash recipes/deepspeed/gpu_bench.sh
# Env knobs: STEPS (default 30), WARMUP (5), STAGES ("2 3"), MODEL (model_gpu.json).
# Output: $OUT/deepspeed_gpu.jsonl (one line per step and run; fields step, loss, step_time_s,
# backend, zero_stage, tag) and a comparison table on stdout.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
OUT="${OUT:-$REPO/out}"
STEPS="${STEPS:-30}"
WARMUP="${WARMUP:-5}"
STAGES="${STAGES:-2 3}"
MODEL="${MODEL:-$HERE/model_gpu.json}"
JSONL="$OUT/deepspeed_gpu.jsonl"
mkdir -p "$OUT"
: > "$JSONL"

# NVLink SHARP (multicast) off, as everywhere on this box.
export NCCL_NVLS_ENABLE=0
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
unset DS_ACCELERATOR   # the CUDA accelerator

# 1. DeepSpeed from the bundled wheels (offline; pip takes only what is missing).
if ! python -c "import deepspeed" >/dev/null 2>&1; then
    echo "== installing deepspeed from $REPO/.whl (offline)"
    DS_BUILD_OPS=0 python -m pip install --no-index --find-links "$REPO/.whl" deepspeed
fi
python - <<'EOF'
import torch, deepspeed, hetccl  # noqa: F401  (hetccl must already be built on this box)
print(f"== torch {torch.__version__}, deepspeed {deepspeed.__version__}, hetccl {hetccl.__version__}, "
      f"{torch.cuda.device_count()} GPUs: {torch.cuda.get_device_name(0)}")
assert torch.cuda.device_count() >= 2, "needs 2 GPUs"
EOF

# 2. Each stage twice: plain NCCL, then hetccl with one emulated vendor per GPU
#    (--hetccl_vendors 1+1: rank r gets HETCCL_VENDOR=v<r>; on one node RANK == LOCAL_RANK).
run() {  # run STAGE BACKEND [extra recipe args...]
    local stage="$1" backend="$2"; shift 2
    echo "== ZeRO-$stage over $backend"
    torchrun --standalone --nproc_per_node 2 "$HERE/train.py" \
        --deepspeed_config "$HERE/gpu_zero$stage.json" --model_config "$MODEL" \
        --steps "$STEPS" --warmup "$WARMUP" --comm_backend "$backend" \
        --out "$JSONL" --tag "zero$stage-$backend" "$@"
}
for stage in $STAGES; do
    run "$stage" nccl
    run "$stage" hetccl --hetccl_vendors 1+1
done

# 3. Comparison: median step time after warm-up, hetccl / NCCL, and the loss agreement.
python - "$JSONL" "$WARMUP" <<'EOF'
import json, statistics, sys
path, warmup = sys.argv[1], int(sys.argv[2])
runs = {}
for line in open(path):
    r = json.loads(line)
    runs.setdefault((r["zero_stage"], r["backend"]), []).append(r)
print(f"\n{'ZeRO':>4} {'backend':>8} {'median step ms':>15} {'vs nccl':>8} {'final loss':>11} {'max |dloss|':>12}")
for stage in sorted({s for s, _ in runs}):
    base = runs.get((stage, "nccl"))
    t_base = statistics.median(r["step_time_s"] for r in base[warmup:]) if base else None
    for backend in ("nccl", "hetccl"):
        rs = runs.get((stage, backend))
        if not rs:
            continue
        t = statistics.median(r["step_time_s"] for r in rs[warmup:])
        ratio = f"{t / t_base:.2f}x" if t_base else "-"
        dl = max(abs(a["loss"] - b["loss"]) for a, b in zip(rs, base)) if base else float("nan")
        print(f"{stage:>4} {backend:>8} {t * 1e3:>15.1f} {ratio:>8} {rs[-1]['loss']:>11.4f} {dl:>12.2e}")
print(f"\n(steps {warmup}.. of each run; per-step records in {path})")
EOF
