#!/usr/bin/env bash
# Builds, checks and times hetccl on the GPU box (1 or more GPUs, Python 3.12, torch 2.11, no
# network). Results land in $OUT (the device tool brings them back); the default steps write
# 8 files, all directly in $OUT:
#   gpu_tests.log          (tests) pytest -m gpu over tests/test_gpu*.py (but test_gpu_ucx.py,
#                          the ucx step's): the GPU suite
#                          (tests/test_gpu_suite.py: every c10d family on CUDA tensors, bad
#                          input, peer death, DDP/FSDP2/DeepSpeed/HF/Megatron/bench train
#                          against references) and test_gpu.py's stream and async checks
#   gpu_figures.jsonl      (tests) one row per figure the suite measured (loss differences,
#                          ms per step of the recipes' correctness runs)
#   gpu_summary.txt        (tests) counts, time, failures, skips, the figures as a table
#                          (.ci/gpu_suite.py summary); the lead commits it under docs/benchmarks/
#   collectives.jsonl      all_reduce / all_gather / reduce_scatter, hetccl 1+1 beside nccl
#   sweep.jsonl            all_reduce with forced engine chunk sizes (tuning.py's evidence;
#                          rows tagged {"chunk_bytes"})
#   train.jsonl            `hetccl bench train`: GPT-2-small DDP efficiency, single / nccl (gloo
#                          on one GPU) / hetccl
#   host.jsonl             host tensors: hetccl 2+2 and 1+1 beside gloo on the box's CPUs
#   doctor.log             `hetccl doctor --copy-test`: the box's PCIe copy ceiling, same session
# Steps not in the default list, one file each (ucx: three):
#   profile.txt            tests/gpu_profile.py: where a small all-reduce spends its time
#   p2p_gpu.jsonl          (p2p) tests/gpu_p2p_bench.py: 1+1 send/recv of device tensors, the
#                          engine's messages beside the host-staged path (p2p_gpu.txt: tables)
#   slots.jsonl            (slots) 1+1 bf16 collectives, the bounded ring geometry beside the
#                          old one (8 MiB x 8 slots), interleaved; rows tagged {"geometry"}
#   dropin.jsonl           (dropin) tests/gpu_dropin_bench.py: one vendor through the drop-in
#                          beside plain NCCL, 1+1 through the drop-in beside the torch face,
#                          and 1+1 with the C API's routes forced (DROPIN_VARIANTS, default:
#                          staged = every call staged through host memory, the path before the
#                          device route; device = the device route at every size)
#                          (dropin.txt: the tables)
#   passthrough.jsonl      one vendor (hetccl:1v, native pass-through) beside nccl, interleaved
#   megatron.txt           (megatron) recipes/megatron/gpu.sh's summary, ITERS=${MEG_ITERS:-10}
#   pingpong.txt           (pingpong) tests/gpu_pingpong.cu: two processes on the one GPU hand a
#                          word back and forth through pinned memory, waiting by a kernel's
#                          spin, by a kernel per round, by stream memory operations, on the
#                          CPU, and by one side's kernel against the other's CPU thread (us
#                          per round trip): whether a one-launch device route can poll across
#                          processes sharing one GPU (docs/capi.md)
#   programs.txt/.jsonl    (programs) tests/gpu_dropin_bench.py: the torch face on the C API
#                          and the drop-in, 1+1, the device route as stream operations beside
#                          device programs (HETCCL_CAPI_ROUTE_LAUNCH=kernel, 4 and 8 blocks a
#                          group, and 8 blocks at every size), torch's NCCL at world size 1 and
#                          the face's own path (face-1+1) in the same run: time, issue cost,
#                          and the face's issue cost step by step (csrc/api/device_program.h)
#   ucx_doctor.log         (ucx) the capability table and UCX's transports on the box
#   ucx_tests.log          (ucx) tests/test_gpu_ucx.py (all collectives, 1+1 and 2+1, hosts
#                          emulated, HETCCL_UCX_DEVICE auto and off: both staged here), test_rdma
#   ucx_bench.jsonl        (ucx) hetccl 1+1 (BRIDGE_VENDORS), hosts emulated: ucx-auto,
#                          ucx-staged, tcp in one run (UCX_MODES), UCX_ROUNDS interleaved rounds;
#                          each row tagged {"mode", "vendors", "round"}; ucx_summary.txt: the
#                          median busbw per mode side by side with ratios to tcp
#   ucx_probe.log          (ucxprobe) tests/gpu_ucx_probe.py: per configuration ok or the
#                          stalled step, with ucx_probe_stacks_*.txt (every thread's frames)
# Usage: bash .ci/gpu-box.sh [build] [tests] [bench] [dropin] [passthrough] [slots] [sweep] [train] [host]
#                            [profile] [p2p] [doctor] [ucx] [ucxprobe] [megatron] [pingpong] [programs]
# (default: build tests bench sweep train host doctor, in that order). Each step is bounded by
# STEP_TIMEOUT seconds (default 240), the tests step by TESTS_TIMEOUT (default 540: the suite
# is meant to take <= ~8 minutes on one H200; run `build` and `tests` as two device commands
# when both together would pass the device tool's 10 minutes). TESTS="tests/test_gpu_suite.py"
# runs one file, PYTEST_K="deepspeed or megatron" a subset (pytest -k), PYTEST_ARGS adds
# pytest flags in place of the default "-n 4 --dist load -v" (pytest-xdist, on the box: the
# whole suite in 389 s on 2026-12-03, about 600 s serially; GPU_TEST_WORKERS sets the count,
# 0 runs serially). A per-test --timeout (pytest-timeout)
# must exceed the tests' own bounds (spawns of up to 300 s), or it cuts a hung test before
# its recorder names the case and the stacks each rank was blocked in (tests/test_harness.py). The tests and megatron steps install the wheels carried in .whl/ that the box
# lacks (deepspeed, megatron-core and their pure-Python dependencies; carried_wheels below);
# without .whl the DeepSpeed and Megatron tests skip with a reason.
# The GPU suite alone, with the wheels (device tool: carry [".whl"]):
#   bash .ci/gpu-box.sh build tests
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore CMAKE_BUILD_PARALLEL_LEVEL=16
OUT=${OUT:-$(mktemp -d)}
T=${STEP_TIMEOUT:-240}
what=${*:-build tests bench sweep train host doctor}
B="python3 -m hetccl.cli bench"
# The wheels of .whl/ whose distribution the box lacks (deepspeed, megatron-core and their
# pure-Python dependencies; .ci/gpu_suite.py wheels says which), installed once into /tmp/site,
# on PYTHONPATH from then on. Nothing the box has is taken from .whl (torch, numpy, CUDA
# libraries stay the box's); libucx is the ucx step's (it rebuilds _C against it).
carried_wheels() {
  if [ ! -d .whl ]; then
    echo "no .whl/: the DeepSpeed and Megatron tests skip (recipes/fetch_gpu_wheels.sh, carry .whl)"
    return 0
  fi
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  if [ ! -f /tmp/site/.hetccl-carried ]; then
    local wheels
    wheels=$(python3 .ci/gpu_suite.py wheels .whl)
    if [ -n "$wheels" ]; then
      echo "installing carried wheels into /tmp/site: $wheels"
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site $wheels 2>&1 | tail -3
    fi
    mkdir -p /tmp/site && touch /tmp/site/.hetccl-carried
  fi
  python3 -c "import deepspeed; print('deepspeed', deepspeed.__version__)" 2>&1 | tail -1
  python3 -c "import megatron.core as m; print('megatron-core', m.__version__)" 2>&1 | tail -1
}
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
# MPS=1: every step under a private CUDA MPS control daemon (pipe and log directories in /tmp,
# quit at the end; the GPU's settings are untouched). The emulated vendors' processes share the
# one GPU, which without MPS time-slices between their contexts: a kernel of one process that
# waits for the other's then waits a whole time slice (pingpong.txt: ~4.5 ms a round trip
# between two spinning kernels, ~2.5 us under MPS). Real vendor groups have a GPU per process.
if [ "${MPS:-0}" = 1 ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/hetccl_mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/hetccl_mps_log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d; then
    echo "MPS: control daemon started ($CUDA_MPS_PIPE_DIRECTORY)"
    trap 'echo quit | nvidia-cuda-mps-control' EXIT
  else
    echo "MPS: nvidia-cuda-mps-control -d failed; the steps run without MPS"
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  fi
fi
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
      # tests/test_gpu*.py, test_gpu_ucx.py included (it skips with its reason where _C lacks
      # UCX: install .whl/libucx_cu13-*.whl before the build step; since HETCCL_UCX_DEVICE=auto
      # never hands device memory to cuda_copy it has no stall to wait out: docs/transports.md)
      GPU_TESTS=$(ls tests/test_gpu*.py | tr '\n' ' ')
      carried_wheels
      : > "$OUT/gpu_figures.jsonl"
      t0=$SECONDS
      # four pytest-xdist workers by default (the box has it and 16 cores): the whole suite in
      # about 390 s instead of about 600; GPU_TEST_WORKERS=0 runs it serially (ms-per-step
      # figures are then those of one test alone on the GPU)
      XDIST=""
      [ "${GPU_TEST_WORKERS:-4}" -gt 0 ] && XDIST="-n ${GPU_TEST_WORKERS:-4} --dist load -v"
      export GPU_SUITE_PYTEST="python3 -m pytest ${TESTS:-$GPU_TESTS} -m gpu${PYTEST_K:+ -k \"$PYTEST_K\"} ${PYTEST_ARGS-$XDIST}"
      # shellcheck disable=SC2086 # TESTS and PYTEST_ARGS are word lists
      HETCCL_GPU_FIGURES="$OUT/gpu_figures.jsonl" HETCCL_CRASH_BACKTRACE=1 PYTHONFAULTHANDLER=1 \
        timeout -k 15 "${TESTS_TIMEOUT:-540}" python3 -m pytest -q ${TESTS:-$GPU_TESTS} \
        -m gpu -p no:cacheprovider -rfEs --durations=12 ${PYTEST_K:+-k "$PYTEST_K"} ${PYTEST_ARGS-$XDIST} 2>&1 \
        | tee "$OUT/gpu_tests.log" | tail -40
      rc=${PIPESTATUS[0]}
      grep -o "hetccl-frame [^ ]* +0x[0-9a-f]*" "$OUT/gpu_tests.log" | sort -u | head -40 \
        | while read -r _ obj off; do echo "$obj $off $(addr2line -f -C -e "$obj" "${off#+}" 2>/dev/null | tr '\n' ' ')"; done
      python3 .ci/gpu_suite.py summary "$OUT" "$rc" "$((SECONDS - t0))" "${TESTS_TIMEOUT:-540}" \
        | tee "$OUT/gpu_summary.txt" ;;
    bench)
      for dt in ${DTYPES:-bfloat16 float32}; do
        timeout $T $B collectives --device cuda --vendors 1+1 --backends hetccl,nccl \
          --colls ${COLLS:-all_reduce,all_gather,reduce_scatter} --minbytes ${MINBYTES:-8K} \
          --maxbytes ${MAXBYTES:-256M} --factor ${FACTOR:-2} --dtype $dt --iters ${ITERS:-20} \
          --no-progress --jsonl "$OUT/collectives.jsonl"
      done ;;
    dropin)
      # the drop-in NCCL (issue 25): one vendor (plain NCCL beside the drop-in, world size 1,
      # interleaved) and 1+1 (drop-in beside the torch face): times, issue cost, #wrong
      # DROPIN_VARIANTS: 1+1 again with other settings (gpu_dropin_bench.py --variants)
      timeout $T python3 tests/gpu_dropin_bench.py --jsonl "$OUT/dropin.jsonl" --factor "${DROPIN_FACTOR:-8}" \
        --maxbytes "${MAXBYTES:-64M}" \
        --variants "${DROPIN_VARIANTS:-staged:HETCCL_STREAM_DEVICE_BYTES=off,device:HETCCL_STREAM_DEVICE_BYTES=1}" \
        2>&1 | tee "$OUT/dropin.txt" | tail -45 ;;
    passthrough)
      timeout $T $B collectives --device cuda --vendors 1+1 --backends hetccl:1v,nccl,hetccl:1v,nccl \
        --colls all_reduce --minbytes 64M --maxbytes 256M --factor 2 --dtype bfloat16 --iters 20 \
        --no-progress --jsonl "$OUT/passthrough.jsonl" ;;
    slots)
      # the bounded ring geometry (HETCCL_SHM_BUDGET_BYTES default, 4 MiB slots) against the
      # geometry before it (8 MiB slots x 8, no budget), interleaved in one run
      for mode in bounded old bounded old; do
        if [ $mode = old ]; then envs="HETCCL_SHM_SLOT_BYTES=8388608 HETCCL_SHM_BUDGET_BYTES=1099511627776"; else envs=""; fi
        env $envs timeout $T $B collectives --device cuda --vendors 1+1 --backends hetccl \
          --colls all_reduce,all_gather,reduce_scatter --minbytes 1M --maxbytes 64M --factor 4 \
          --dtype bfloat16 --iters 20 --no-progress --jsonl /tmp/slot_rows.jsonl
        python3 -c "import json,sys; [print(json.dumps({**json.loads(l), 'geometry': sys.argv[1]})) for l in open('/tmp/slot_rows.jsonl')]" \
          "$mode" >> "$OUT/slots.jsonl" 2>/dev/null
        rm -f /tmp/slot_rows.jsonl
      done ;;
    sweep)
      for c in ${CHUNKS:-262144 1048576 4194304 8388608}; do
        HETCCL_CHUNK_BYTES=$c timeout $T $B collectives --device cuda --vendors 1+1 \
          --backends hetccl --colls all_reduce --minbytes 256K --maxbytes 64M --factor 4 \
          --dtype bfloat16 --iters 20 --no-progress --jsonl /tmp/sweep_rows.jsonl
        python3 -c "import json,sys; [print(json.dumps({**json.loads(l), 'chunk_bytes': int(sys.argv[1])})) for l in open('/tmp/sweep_rows.jsonl')]" \
          "$c" >> "$OUT/sweep.jsonl" 2>/dev/null
        rm -f /tmp/sweep_rows.jsonl
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
    p2p)
      # cross-vendor send/recv of device tensors: the engine's messages beside the host-staged
      # path, interleaved (tests/gpu_p2p_bench.py; rows in $OUT/p2p_gpu.jsonl)
      timeout $T python3 tests/gpu_p2p_bench.py "$OUT" 2>&1 | tee "$OUT/p2p_gpu.txt" | tail -8 ;;
    megatron)
      # recipes/megatron/gpu.sh (one GPU: pp=2 correctness with both stages' processes on the
      # GPU, even and uneven split, beside a pp=1 run, and the recipe trained on the GPU); only
      # its summary comes back
      carried_wheels
      rm -rf /tmp/hetccl-megatron
      OUT=/tmp/hetccl-megatron ITERS=${MEG_ITERS:-10} PY=python3 timeout -k 15 $((T * 2)) \
        bash recipes/megatron/gpu.sh 2>&1 | tail -5
      cp /tmp/hetccl-megatron/megatron_summary.txt "$OUT/megatron.txt" 2>/dev/null \
        || echo "no megatron summary (/tmp/hetccl-megatron/megatron_gpu.log on the box)" ;;
    doctor)
      timeout $T python3 -m hetccl.cli doctor --copy-test 2>&1 | tee "$OUT/doctor.log" | tail -4 ;;
    pingpong)
      # needs nvcc (the box's CUDA toolkit); no hetccl build
      nvcc -O2 -o /tmp/gpu_pingpong tests/gpu_pingpong.cu &&
        timeout "$T" /tmp/gpu_pingpong "${PINGPONG_ROUNDS:-2000}" 2>&1 | tee "$OUT/pingpong.txt"
      ;;
    programs)
      # device programs against the route's stream operations (about 2 minutes): the torch
      # face on the C API and the drop-in, 1+1, each with the route's stream operations
      # (default) and as device programs (k4: the default 4 blocks a group, k8, k16, k8all: 8
      # blocks and the device route at every size), torch's NCCL at world size 1 and the face's own
      # path in the same run, and the face with its joins at issue (nodefer:
      # HETCCL_FACE_DEFER_JOIN=0); rank 0 of the face times its issue steps (--profile-issue).
      # PROGRAMS_ONLY narrows the configurations; PROGRAMS_TAG names the files (programs_TAG.*)
      K="HETCCL_CAPI_ROUTE_LAUNCH=kernel"
      tag=${PROGRAMS_TAG:+_$PROGRAMS_TAG}
      timeout $((T + 60)) python3 tests/gpu_dropin_bench.py --timeout 60 --jsonl "$OUT/programs$tag.jsonl" \
        --profile-issue --only "${PROGRAMS_ONLY:-nccl-1,face-1+1,dropin-1+1,dropin-1+1-k4,facecapi-1+1,facecapi-1+1-k4,facecapi-1+1-k8,facecapi-1+1-k16,facecapi-1+1-k8all}" \
        --variants "k4:$K" \
        --face-variants "k4:$K,k8:$K;HETCCL_CAPI_PROGRAM_BLOCKS=8,k16:$K;HETCCL_CAPI_PROGRAM_BLOCKS=16,k8all:$K;HETCCL_CAPI_PROGRAM_BLOCKS=8;HETCCL_STREAM_DEVICE_BYTES=1,nodefer:HETCCL_FACE_DEFER_JOIN=0" \
        --factor 8 --maxbytes 64M --issue-sizes 8K,512K,2M,32M,64M > "$OUT/programs$tag.txt" 2>&1
      grep -v "^issue profile\|^  \[" "$OUT/programs$tag.txt" | tail -60 ;;
    ucxprobe)
      # Which thread and call stall UCX's direct device path (HETCCL_UCX_DEVICE=force over
      # cuda_copy: without / with prepared handles, the latter also eager-only), staged, and the
      # default (auto: staged here), each in fresh processes, every step bounded; stacks of
      # stalled ranks in $OUT/ucx_probe_stacks_*.txt, a CAUSE line where they show the runtime
      # deadlock (tests/gpu_ucx_probe.py). At most PROBE_CONFIG_TIMEOUT (45) s per configuration
      # (PROBE_CONFIGS picks some).
      ucx_build || continue
      PROBE_OUT="$OUT" PROBE_CONFIG_TIMEOUT=${PROBE_CONFIG_TIMEOUT:-45} timeout $((5 * ${PROBE_CONFIG_TIMEOUT:-45} + 20)) \
        python3 tests/gpu_ucx_probe.py 2>&1 | grep -v "UCX  WARN" > "$OUT/ucx_probe.log"
      grep -E "^(===|---|  rank|      thread|  only|  CAUSE|CAUSE|auto |direct-|VERDICT)" "$OUT/ucx_probe.log" | cut -c1-400 ;;
    ucx)
      # Bounded for one late run (about 4 minutes after the build): the doctor's UCX and RDMA
      # lines, then ucx-auto / ucx-staged / tcp rows (1+1, hosts emulated; 64 KiB - 64 MiB,
      # bf16, all_reduce / all_gather / reduce_scatter; each mode at most UCX_ROW_TIMEOUT s: a
      # stalled mode leaves rows missing, not the run), then the UCX tests if UCX_BUDGET allows.
      ucx_build || continue
      t_ucx=$SECONDS
      python3 -m hetccl.cli doctor 2>&1 | sed -n '/bridge transports/,/^  host identity/p' | tee "$OUT/ucx_doctor.log"
      # UCX_ROUNDS (default 1): the modes run that many times, interleaved (round 1's modes,
      # then round 2's, ...), and the summary gives each cell's median over the rounds, because
      # single runs on this shared box move by 20-30 % (tcp itself up to 2.6x between runs)
      for round in $(seq ${UCX_ROUNDS:-1}); do
      for v in ${BRIDGE_VENDORS:-1+1}; do
        # ucx-auto: the default (direct only where UCX's device path is runtime-free, else
        # staged: staged on this box); ucx-force: direct over cuda_copy, which can deadlock
        # (docs/transports.md), only when UCX_MODES names it
        for mode in ${UCX_MODES:-ucx-auto ucx-staged tcp}; do
          case $mode in
            ucx-auto) e="HETCCL_TRANSPORT=ucx HETCCL_UCX_DEVICE=auto" ;;
            ucx-force) e="HETCCL_TRANSPORT=ucx HETCCL_UCX_DEVICE=force" ;;
            ucx-staged) e="HETCCL_TRANSPORT=ucx HETCCL_UCX_DEVICE=off" ;;
            # the default's lanes without striping (each message whole on one lane), and 8 lanes
            ucx-nostripe) e="HETCCL_TRANSPORT=ucx HETCCL_UCX_STRIPE_BYTES=0" ;;
            ucx-8lanes) e="HETCCL_TRANSPORT=ucx HETCCL_UCX_LANES=8" ;;
            ucx-stripe128k) e="HETCCL_TRANSPORT=ucx HETCCL_UCX_STRIPE_BYTES=131072" ;;
            ucx-stripe1m) e="HETCCL_TRANSPORT=ucx HETCCL_UCX_STRIPE_BYTES=1048576" ;;
            # progress threads polling 1 ms after their last event before they sleep
            ucx-spin1ms) e="HETCCL_TRANSPORT=ucx HETCCL_UCX_SPIN_US=1000" ;;
            ucx-stripe1m-spin1ms) e="HETCCL_TRANSPORT=ucx HETCCL_UCX_STRIPE_BYTES=1048576 HETCCL_UCX_SPIN_US=1000" ;;
            # UCX's eager protocol up to 8 MiB (no rendezvous handshake per message)
            ucx-eager) e="HETCCL_TRANSPORT=ucx UCX_RNDV_THRESH=8M" ;;
            # no message bound (HETCCL_UCX_MAX_MESSAGE=0): chunks above UCX's largest zero-copy
            # message go "fragmented copy-in copy-out" (docs/transports.md)
            ucx-unbounded) e="HETCCL_TRANSPORT=ucx HETCCL_UCX_MAX_MESSAGE=0" ;;
            tcp) e="HETCCL_TRANSPORT=tcp" ;;
          esac
          rm -f /tmp/ucx_rows.jsonl
          env HETCCL_EMULATE_HOSTS=1 CUDA_MODULE_LOADING=EAGER $e timeout ${UCX_ROW_TIMEOUT:-50} $B collectives \
            --device cuda --vendors $v --backends hetccl --colls ${BRIDGE_COLLS:-all_reduce,all_gather,reduce_scatter} \
            --minbytes ${BRIDGE_MINBYTES:-64K} --maxbytes ${BRIDGE_MAXBYTES:-64M} --factor 4 \
            --dtype bfloat16 --iters ${ITERS:-10} --timeout ${UCX_ROW_TIMEOUT:-50} --no-progress \
            --jsonl /tmp/ucx_rows.jsonl 2>&1 | grep -E "^ +(all_|reduce_)" | sed "s/^/$mode /"
          rc=${PIPESTATUS[0]}
          echo "$mode: $(cat /tmp/ucx_rows.jsonl 2>/dev/null | wc -l) rows (exit $rc; 124: stopped at UCX_ROW_TIMEOUT)"
          python3 -c "import json,sys; [print(json.dumps({**json.loads(l), 'mode': sys.argv[1], 'vendors': sys.argv[2], 'round': int(sys.argv[3])})) for l in open('/tmp/ucx_rows.jsonl')]" \
            $mode $v $round >> "$OUT/ucx_bench.jsonl" 2>/dev/null
        done
      done
      done
      python3 - "$OUT/ucx_bench.jsonl" <<'PY' 2>/dev/null | tee "$OUT/ucx_summary.txt"
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
by = {}
for r in rows:
    by.setdefault((r["collective"], r["size_bytes"], r["mode"]), []).append(r)
keys = sorted({(c, s) for c, s, _ in by})
modes = list(dict.fromkeys(r["mode"] for r in rows))
rounds = max(r.get("round", 1) for r in rows)
print(f"# busbw GB/s by mode (median of {rounds} interleaved round(s)); each UCX mode's ratio "
      "to tcp; #wrong over all modes and rounds")
for c, s in keys:
    cell = {m: by.get((c, s, m), []) for m in modes}
    bw = {m: (round(statistics.median(x["busbw_gbs"] for x in rs), 2) if rs else None)
          for m, rs in cell.items()}
    wrong = sum(int(x["wrong"]) for rs in cell.values() for x in rs)
    ratio = lambda m: f"{bw[m] / bw['tcp']:.2f}" if bw[m] and bw.get("tcp") else "-"
    print(f"{c:<15} {s:>10} " + " ".join(f"{m} {bw[m] if bw[m] is not None else '-'}" for m in cell)
          + f"  wrong {wrong}  " + " ".join(f"{m}/tcp {ratio(m)}" for m in modes if m != "tcp"))
PY
      if [ $((SECONDS - t_ucx)) -lt $((${UCX_BUDGET:-210} - 120)) ]; then
        HETCCL_CRASH_BACKTRACE=1 PYTHONFAULTHANDLER=1 timeout 90 python3 -m pytest -q \
          ${BRIDGE_TESTS:-tests/test_gpu_ucx.py tests/test_rdma.py} -k "not 2+1" -m "gpu or not gpu" \
          -p no:cacheprovider 2>&1 | tee "$OUT/ucx_tests.log" | tail -8
      else
        echo "ucx tests skipped: $((SECONDS - t_ucx)) s of UCX_BUDGET=${UCX_BUDGET:-210} s used"
      fi ;;
  esac
done
echo "=== done ($(date +%T))"
