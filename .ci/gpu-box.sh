#!/usr/bin/env bash
# One script that builds, checks and times the GPU data path on the GPU box (2 GPUs, Python 3.12,
# torch 2.11, no network). Results land in $OUT (the device tool brings them back):
#   gpu_tests.log            pytest -m gpu (CUDA correctness, stream semantics, no NCCL across vendors)
#   collectives_gpu.jsonl    hetccl (1+1 emulated vendors), hetccl:1v (pass-through), nccl, gloo
#   collectives_gpu.png      busbw vs size
#   ddp_gpu.jsonl            small GPT DDP: NCCL reference vs hetccl 1+1, losses and step times
# Usage: bash .ci/gpu-box.sh [tests] [bench] [ddp]   (default: all three)
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
OUT=${OUT:-$(mktemp -d)}
STEPS=${STEPS:-all}
what=${*:-tests bench ddp}
nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())"
if ! python3 -c "import hetccl._C" 2>/dev/null || [ "${REBUILD:-0}" = 1 ]; then
  python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3
fi
python3 -m hetccl.cli doctor | head -8
for w in $what; do
  case $w in
    tests) python3 -m pytest -q -x tests/test_gpu.py -m gpu -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -15 ;;
    bench)
      for dt in ${DTYPES:-bfloat16 float32}; do
        python3 -m hetccl.cli bench collectives --device cuda --vendors 1+1 \
          --backends hetccl,hetccl:1v,nccl,gloo --minbytes 1M --maxbytes ${MAXBYTES:-256M} \
          --dtype $dt --iters ${ITERS:-10} --no-progress --jsonl "$OUT/collectives_gpu.jsonl" \
          --plot "$OUT/collectives_gpu_$dt.png"
      done ;;
    ddp)
      python3 -m hetccl.cli bench ddp --backend nccl --device cuda --nranks 2 --jsonl "$OUT/ddp_gpu.jsonl"
      python3 -m hetccl.cli bench ddp --backend hetccl --device cuda --vendors 1+1 \
        --jsonl "$OUT/ddp_gpu.jsonl" --compare "$OUT/ddp_gpu.jsonl" ;;
  esac
done
