#!/usr/bin/env bash
# Megatron-core over hetccl on the GPU box: the figures of docs/integrations/megatron.md.
#
#   bash recipes/megatron/gpu.sh                      # from the repository root; OUT=... PARTS="a b"
#   bash recipes/megatron/gpu.sh --device cpu         # the same logic on CPU with a tiny model
#
# Part a (pipeline stages across vendors): recipes/megatron/gpu_1p1_350m.yaml with pp=2, one
#   stage per emulated vendor, the second GPU emulated 2x slower (HETCCL_SLOWDOWN=2: extra
#   matrix multiplications on its stream, the GPU is consumed, nothing sleeps); the even split
#   (12 + 12 layers) against hetccl.balance.plan_stages' split from measured per-layer times,
#   beside pp=1 data parallelism with hetccl.balance's micro-batch balancer on the same pair.
# Part b (realistic recipe): the ~350M-parameter GPT in bf16, dp=2 over hetccl 1+1 against
#   plain NCCL: ms per iteration, TFLOP/s per GPU, losses.
# With one GPU (or NGPU=1), what needs two is skipped with a message; instead part a checks pp=2
# correctness with both stages' processes sharing the one GPU (even and planned splits against
# a pp=1 single-process run: NOT a speed figure), and part b trains the recipe on the one GPU.
#
# Writes under $OUT (default ./out): megatron_rows.jsonl (one row per iteration and run, with
# "tag"), megatron_summary.txt, megatron_gpu.log. megatron-core comes from .whl/ (recreate it
# with bash recipes/fetch_gpu_wheels.sh; carry it to the box); hetccl is built here if needed.
set -uo pipefail
cd "$(dirname "$0")/../.."
DEVICE=cuda
while [ $# -gt 0 ]; do
  case $1 in
    --device) DEVICE=$2; shift 2;;
    --device=*) DEVICE=${1#*=}; shift;;
    -h|--help) sed -n 2,22p "$0"; exit 0;;
    *) echo "gpu.sh: unknown option $1" >&2; exit 2;;
  esac
done
OUT=${OUT:-$PWD/out}
PARTS=${PARTS:-"a b"}
PY=${PY:-python}
mkdir -p "$OUT"
JSONL="$OUT/megatron_rows.jsonl"; LOG="$OUT/megatron_gpu.log"; SUMMARY="$OUT/megatron_summary.txt"
: > "$JSONL"; : > "$LOG"
export NCCL_NVLS_ENABLE=0            # keep NVLink SHARP off (KINDS.md)
export PYTHONUNBUFFERED=1
if [ "$DEVICE" = cpu ]; then export OMP_NUM_THREADS=1; else export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}; fi
log() { echo "$@" | tee -a "$LOG"; }

log "== gpu.sh $(date -Is) device=$DEVICE parts: $PARTS out: $OUT"
if [ "$DEVICE" = cuda ]; then
  if ! $PY -c "import megatron.core" >/dev/null 2>&1; then
    if $PY -c "import triton" >/dev/null 2>&1; then MCORE=0.19.2; else MCORE=0.16.1; fi
    log "== installing megatron-core $MCORE from .whl/ (pip install --no-build-isolation)"
    $PY -m pip install -q --no-build-isolation --no-index --find-links .whl "megatron-core==$MCORE" \
      >>"$LOG" 2>&1 || log "== megatron-core install FAILED (carry .whl: bash recipes/fetch_gpu_wheels.sh)"
  fi
  if [ "${REBUILD:-0}" = 1 ] || ! $PY -c "import hetccl._C, hetccl.integrations.megatron_train" >/dev/null 2>&1; then
    log "== building hetccl (pip install --no-build-isolation --no-deps -e .)"
    $PY -m pip install -q --no-build-isolation --no-deps -e . >>"$LOG" 2>&1 || log "== build FAILED"
  fi
fi
$PY -W ignore - <<'EOF' 2>&1 | tee -a "$LOG"
import torch
print(f"== torch {torch.__version__}, {torch.cuda.device_count()} GPUs"
      + (f": {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""))
try:
    import megatron.core as mc, hetccl
    print(f"== megatron-core {mc.__version__}, hetccl {hetccl.__version__} from {hetccl.__file__}")
except Exception as e:  # noqa: BLE001
    print(f"== NOT importable: {e}")
EOF

RECIPE=recipes/megatron/gpu_1p1_350m.yaml
if [ "$DEVICE" = cuda ]; then
  NGPU=${NGPU:-$($PY -c "import torch; print(torch.cuda.device_count())")}
  ITERS=${ITERS:-30}
  SIZE=()
  REF_BACKEND=nccl
  UNEVEN='[16, 8]'
else
  NGPU=${NGPU:-2}                     # CPU: two processes stand for the two GPUs (NGPU=1: the
                                      # one-GPU path)
  ITERS=${ITERS:-6}
  SIZE=(--set hetccl.device=cpu --set bf16=false --set num_layers=8 --set hidden_size=64
        --set num_attention_heads=4 --set seq_length=32 --set max_position_embeddings=32
        --set vocab_size=256 --set micro_batch_size=2 --set global_batch_size=16
        --set lr_warmup_iters=1 --set hetccl.probe_iters=3)
  REF_BACKEND=gloo
  UNEVEN='[6, 2]'
fi
SLOW='hetccl.vendors=[{name: nv, gpus: 1}, {name: am, gpus: 1, slowdown: 2.0}]'
ONE='hetccl.vendors=[{name: nv, gpus: 1}]'

# train NPROC TAG [args...]: one torchrun job, rows tagged TAG into $JSONL
train() {
  local n=$1 tag=$2; shift 2
  log "== [$tag] $n processes: $*"
  local t0=$SECONDS
  timeout 560 $PY -m torch.distributed.run --standalone --nproc_per_node "$n" \
      -m hetccl.integrations.megatron --config "$RECIPE" --iters "$ITERS" "${SIZE[@]}" \
      --out "$JSONL" --tag "$tag" --quiet "$@" >>"$LOG" 2>&1
  local rc=$?
  log "== [$tag] rc=$rc after $((SECONDS - t0)) s"
  [ $rc = 0 ] || tail -25 "$LOG" | grep -v "^== " | sed 's/^/    /'
  echo "{\"tag\": \"$tag-status\", \"rc\": $rc, \"seconds\": $((SECONDS - t0))}" >> "$JSONL"
}

for part in $PARTS; do
case $part in
a)
  PP=(--set pipeline_model_parallel_size=2 --set "$SLOW" --emulate-vendors)
  if [ "$NGPU" -ge 2 ]; then
    train 2 a-pp2-even "${PP[@]}" --set hetccl.stages=even
    train 2 a-pp2-plan "${PP[@]}" --set hetccl.stages=plan
    train 2 a-pp1-dp-balanced --set "$SLOW" --emulate-vendors --set hetccl.balance=auto \
        --set hetccl.max_micro=16
    train 2 a-pp1-dp-even --set "$SLOW" --emulate-vendors
  else
    log "== [a] the speed figure needs 2 GPUs (one per pipeline stage); this machine has $NGPU."
    log "== [a] running pp=2 CORRECTNESS instead: both stages' processes share GPU 0 (NOT a speed figure)"
    PP1=(--set pipeline_model_parallel_size=2 --emulate-vendors
         --set 'hetccl.vendors=[{name: nv, gpus: 1}, {name: am, gpus: 1}]')
    train 2 a1gpu-pp2-even "${PP1[@]}" --set hetccl.stages=even
    train 2 a1gpu-pp2-uneven "${PP1[@]}" --set "hetccl.stages=$UNEVEN"
    train 1 a1gpu-pp1-reference --set "$ONE" --emulate-vendors
  fi
  ;;
b)
  if [ "$NGPU" -ge 2 ]; then
    train 2 b-hetccl-1p1 --emulate-vendors
    train 2 b-nccl --emulate-vendors --backend "$REF_BACKEND"
  else
    log "== [b] hetccl 1+1 against NCCL needs 2 GPUs; this machine has $NGPU: training the recipe on one GPU"
    train 1 b1gpu-single --set "$ONE" --emulate-vendors
  fi
  ;;
*) log "== unknown part $part (a b)";;
esac
done

$PY recipes/megatron/summarize.py "$JSONL" 2>&1 | tee "$SUMMARY" | tee -a "$LOG"
log "== done $(date +%T); results in $OUT"
