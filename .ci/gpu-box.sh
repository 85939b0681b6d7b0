#!/usr/bin/env bash
# Builds, checks and times hetccl on the GPU box (2 GPUs, Python 3.12, torch 2.11, no network).
# Results land in $OUT (the device tool brings them back):
#   gpu_tests.log          pytest -m gpu: CUDA correctness, stream semantics, async issue, DDP,
#                          argument errors, no NCCL across emulated vendors
#   collectives.jsonl      all_reduce / all_gather / reduce_scatter, hetccl 1+1 beside nccl
#   sweep.jsonl            all_reduce with forced engine chunk sizes (tuning.py's evidence)
#   train.jsonl            `hetccl bench train`: GPT-2-small DDP efficiency, single / nccl / hetccl
#   host.jsonl             host tensors: hetccl 2+2 and 1+1 beside gloo on the box's CPUs
#   doctor.log             `hetccl doctor --copy-test`: the box's PCIe copy ceiling, same session
#   profile.txt            tests/gpu_profile.py: where a small all-reduce spends its time
#   passthrough.jsonl      one vendor (hetccl:1v, native pass-through) beside nccl, interleaved
#   ucx_doctor.log         (ucx step) the capability table and UCX's transports on the box
#   ucx_tests.log          (ucx step) tests/test_gpu_ucx.py (all collectives, 1+1 and 2+1, hosts
#                          emulated, device memory direct and host-staged), test_ucx, choice tests
#   ucx_bench.jsonl        (ucx step) hetccl 1+1 and 2+1, hosts emulated: ucx-device,
#                          ucx-staged, tcp in one run; each row tagged {"mode", "vendors"}
# Usage: bash .ci/gpu-box.sh [build] [tests] [bench] [passthrough] [sweep] [train] [host]
#                            [profile] [doctor] [ucx] [ucxprobe]
# (default: all but ucx, in that order). Each step is bounded by STEP_TIMEOUT seconds (default
# 240). The ucx step needs the UCX wheel carried in .whl/ (recipes/fetch_gpu_wheels.sh; the box
# has no registry), e.g. with the device tool: carry [".whl"], command
#   bash .ci/gpu-box.sh ucx
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore CMAKE_BUILD_PARALLEL_LEVEL=16
OUT=${OUT:-$(mktemp -d)}
T=${STEP_TIMEOUT:-240}
what=${*:-build tests bench sweep train host doctor}
B="python3 -m hetccl.cli bench"
# UCX from the carried wheel (the version pyproject's [ucx] extra pins), then a rebuild so that
# _C has the UCX transport ("hetccl: UCX transport: ON"); once per run
ucx_build() {
  python3 -c "import hetccl._C as c, sys; sys.exit('ucx' not in c.transport_names())" 2>/dev/null && return 0
  whl=$(ls .whl/libucx_cu13-1.22.0-*.whl 2>/dev/null | head -1)
  [ -n "$whl" ] || { echo "no .whl/libucx_cu13-1.22.0-*.whl: run recipes/fetch_gpu_wheels.sh here and carry .whl"; return 1; }
  python3 -m pip install -q --no-index --no-deps "$whl" 2>&1 | tail -2
  python3 -m pip install -q --no-build-isolation --no-deps -e . \
    --config-settings=cmake.build-type=RelWithDebInfo --config-settings=install.strip=false \
    2>&1 | tail -3
}
for w in $what; do
  echo "=== $w ($(date +%T))"
  case $w in
    build)
      nvidia-smi -L
      python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())"
      # RelWithDebInfo, unstripped: a crash backtrace (tests step) names functions and lines
      python3 -m pip install -q --no-build-isolation --no-deps -e . \
        --config-settings=cmake.build-type=RelWithDebInfo --config-settings=install.strip=false \
        2>&1 | tail -3
      python3 -m hetccl.cli doctor | head -12 ;;
    tests)
      HETCCL_CRASH_BACKTRACE=1 PYTHONFAULTHANDLER=1 timeout $T python3 -m pytest -q -x \
        tests/test_gpu.py -m gpu -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
      grep -o "hetccl-frame [^ ]* +0x[0-9a-f]*" "$OUT/gpu_tests.log" | sort -u | head -40 \
        | while read -r _ obj off; do echo "$obj $off $(addr2line -f -C -e "$obj" "${off#+}" 2>/dev/null | tr '\n' ' ')"; done ;;
    bench)
      for dt in ${DTYPES:-bfloat16 float32}; do
        timeout $T $B collectives --device cuda --vendors 1+1 --backends hetccl,nccl \
          --colls ${COLLS:-all_reduce,all_gather,reduce_scatter} --minbytes ${MINBYTES:-8K} \
          --maxbytes ${MAXBYTES:-256M} --factor ${FACTOR:-2} --dtype $dt --iters ${ITERS:-20} \
          --no-progress --jsonl "$OUT/collectives.jsonl"
      done ;;
    passthrough)
      timeout $T $B collectives --device cuda --vendors 1+1 --backends hetccl:1v,nccl,hetccl:1v,nccl \
        --colls all_reduce --minbytes 64M --maxbytes 256M --factor 2 --dtype bfloat16 --iters 20 \
        --no-progress --jsonl "$OUT/passthrough.jsonl" ;;
    sweep)
      for c in ${CHUNKS:-262144 1048576 4194304 8388608}; do
        HETCCL_CHUNK_BYTES=$c timeout $T $B collectives --device cuda --vendors 1+1 \
          --backends hetccl --colls all_reduce --minbytes 256K --maxbytes 64M --factor 4 \
          --dtype bfloat16 --iters 20 --no-progress --jsonl "$OUT/sweep_$c.jsonl"
      done ;;
    train)
      timeout $((T * 2)) $B train --device cuda --steps ${TRAIN_STEPS:-8} --no-progress \
        --jsonl "$OUT/train.jsonl" ;;
    host)
      timeout $T $B collectives --device cpu --vendors 2+2 --backends hetccl,gloo \
        --colls all_reduce --minbytes 8K --maxbytes 32M --factor 4 --iters 10 --no-progress \
        --jsonl "$OUT/host.jsonl"
      timeout $T $B collectives --device cpu --vendors 1+1 --backends hetccl,gloo \
        --colls all_reduce --minbytes 8K --maxbytes 32M --factor 8 --iters 20 --no-progress \
        --jsonl "$OUT/host.jsonl" ;;
    profile)
      timeout $T python3 tests/gpu_profile.py "$OUT" 2>&1 | head -60 ;;
    doctor)
      timeout $T python3 -m hetccl.cli doctor --copy-test 2>&1 | tee "$OUT/doctor.log" | tail -4 ;;
    ucxprobe)
      # which layer of the direct device path stalls, each step bounded (tests/gpu_ucx_probe.py)
      ucx_build || continue
      timeout $T python3 tests/gpu_ucx_probe.py 2>&1 | grep -v "UCX  WARN" | tee "$OUT/ucx_probe.log" | tail -8 ;;
    ucx)
      ucx_build || continue
      python3 -m hetccl.cli doctor 2>&1 | sed -n '/bridge transports/,/^  UCX/p' | tee "$OUT/ucx_doctor.log"
      HETCCL_CRASH_BACKTRACE=1 PYTHONFAULTHANDLER=1 timeout $((T * 2)) python3 -m pytest -q \
        ${BRIDGE_TESTS:-tests/test_gpu_ucx.py tests/test_ucx.py tests/test_transport_choice.py} -m "gpu or not gpu" \
        -p no:cacheprovider 2>&1 | tee "$OUT/ucx_tests.log" | tail -25
      # ucx-device vs ucx-staged vs tcp, hosts emulated (no shm, no device IPC between vendors)
      for v in ${BRIDGE_VENDORS:-1+1 2+1}; do
        for mode in ucx-device ucx-staged tcp; do
          case $mode in
            ucx-device) e="HETCCL_TRANSPORT=ucx HETCCL_UCX_DEVICE=auto" ;;
            ucx-staged) e="HETCCL_TRANSPORT=ucx HETCCL_UCX_DEVICE=off" ;;
            tcp) e="HETCCL_TRANSPORT=tcp" ;;
          esac
          rm -f /tmp/ucx_rows.jsonl
          env HETCCL_EMULATE_HOSTS=1 $e timeout $T $B collectives --device cuda --vendors $v \
            --backends hetccl --colls ${BRIDGE_COLLS:-all_reduce,all_gather,reduce_scatter} \
            --minbytes ${BRIDGE_MINBYTES:-64K} --maxbytes ${BRIDGE_MAXBYTES:-256M} --factor 4 \
            --dtype bfloat16 --iters ${ITERS:-20} --no-progress --jsonl /tmp/ucx_rows.jsonl
          python3 -c "import json,sys; [print(json.dumps({**json.loads(l), 'mode': sys.argv[1], 'vendors': sys.argv[2]})) for l in open('/tmp/ucx_rows.jsonl')]" \
            $mode $v >> "$OUT/ucx_bench.jsonl" 2>/dev/null
        done
      done ;;
  esac
done
echo "=== done ($(date +%T))"
