#!/bin/bash
# one-off device run (session 21): GPU suite on this revision, then UCX lane threads vs tcp
set -o pipefail
export TESTS_TIMEOUT=330
python3 -m pip install -q --no-index --no-deps .whl/libucx_cu13-1.22.0-*.whl
python3 .ci/gpu_suite.py fingerprint
bash .ci/gpu-box.sh build tests 2>&1 | tee $OUT/log | grep -E "^result|passed|failed" | tail -3
B="python3 -m hetccl.cli bench"
for cfg in "tcp:HETCCL_TRANSPORT=tcp" "ucx1:HETCCL_TRANSPORT=ucx" "ucx2t:HETCCL_TRANSPORT=ucx HETCCL_UCX_LANES=2" "ucx4t:HETCCL_TRANSPORT=ucx HETCCL_UCX_LANES=4" "ucx8t:HETCCL_TRANSPORT=ucx HETCCL_UCX_LANES=8"; do
  name=${cfg%%:*}; e=${cfg#*:}
  env HETCCL_EMULATE_HOSTS=1 CUDA_MODULE_LOADING=EAGER $e timeout 45 $B collectives --device cuda --vendors 1+1 --backends hetccl \
    --colls all_reduce,all_gather,reduce_scatter --minbytes 1M --maxbytes 64M --factor 4 --dtype bfloat16 --iters 10 --timeout 40 --no-progress \
    --jsonl $OUT/rows_$name.jsonl 2>&1 | grep -E "^ +(all_|reduce_)" | sed "s/^/$name /" | awk '{print $1,$2,$5,$10,$11}'
done
