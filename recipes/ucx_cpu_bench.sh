#!/bin/bash
# UCX on a CPU machine, side by side in one run (docs/benchmarks.md, "UCX transport"):
# ucx_perftest (UCX's own tag_bw over tcp, default and with hetccl's HETCCL_UCX_TUNING values)
# beside `hetccl bench transport` for ucx untuned, ucx tuned (1 and 2 lanes) and tcp, 3 rounds.
# Usage: bash recipes/ucx_cpu_bench.sh [OUTDIR]   (default OUTDIR: out/ucx_cpu)
set -u
cd "$(dirname "$0")/.."
OUTDIR=${1:-out/ucx_cpu}; mkdir -p "$OUTDIR"
D=$(python -c "import libucx,os;print(os.path.dirname(libucx.__file__))")
J=$OUTDIR/transport_ucx_cpu.jsonl; P=$OUTDIR/transport_ucx_cpu_perftest.txt
pt() {  # label, env...
  local label=$1; shift; local port=$((15000 + RANDOM % 1000))
  (env LD_LIBRARY_PATH=$D/lib UCX_NET_DEVICES=lo UCX_TLS=tcp,self "$@" $D/bin/ucx_perftest -p $port -t tag_bw -s 67108864 -n 20 >/dev/null 2>&1 &)
  sleep 1
  env LD_LIBRARY_PATH=$D/lib UCX_NET_DEVICES=lo UCX_TLS=tcp,self "$@" $D/bin/ucx_perftest 127.0.0.1 -p $port -t tag_bw -s 67108864 -n 20 2>&1 | awk -v l="$label" -v r=$round '/Final/{printf "round %d %-22s %.3f GB/s  (%s MB/s per UCX)\n", r, l, $7*1.048576/1000, $7}' | tee -a $P
  sleep 1
}
echo "# $(date -u +%F) ucx_perftest -t tag_bw -s 64M -n 20, UCX_TLS=tcp,self UCX_NET_DEVICES=lo; $(nproc) cores" > $P
rm -f $J
for round in 1 2 3; do
  pt "perftest-default"
  pt "perftest-tuned" UCX_TCP_TX_SEG_SIZE=1M UCX_TCP_RX_SEG_SIZE=4M
  HETCCL_UCX_TUNING=none python -m hetccl.cli bench transport --transports ucx --ucx-lanes 1 --sizes 1M,64M --modes uni --repeat 5 --jsonl $J > /dev/null 2>&1
  python -m hetccl.cli bench transport --transports ucx --ucx-lanes 1 --sizes 1M,64M --modes uni --repeat 5 --jsonl $J > /dev/null 2>&1
  python -m hetccl.cli bench transport --transports ucx --ucx-lanes 2 --sizes 1M,64M --modes uni --repeat 5 --jsonl $J > /dev/null 2>&1
  python -m hetccl.cli bench transport --transports tcp --sizes 1M,64M --modes uni --repeat 5 --jsonl $J > /dev/null 2>&1
  echo "round $round load $(cut -d' ' -f1-3 /proc/loadavg)" >> $P
done
echo done
