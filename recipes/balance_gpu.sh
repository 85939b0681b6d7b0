#!/usr/bin/env bash
# Every GPU figure of issue 16 (heterogeneity-aware balancing on real GPUs), in one run on the
# 2 x H200 box (Python 3.12, torch 2.11, no network, hetccl built with
# `pip install --no-build-isolation -e .`; DeepSpeed comes from the wheels in .whl/, made by
# recipes/fetch_gpu_wheels.sh and carried to the box). About 6 minutes.
#
#   OUT=/some/dir bash recipes/balance_gpu.sh            # all parts
#   OUT=/some/dir bash recipes/balance_gpu.sh c d        # some parts
#   DEVICE=cpu OUT=/tmp/x bash recipes/balance_gpu.sh    # tiny CPU version (checks the script;
#                                                        # its figures mean nothing)
# Parts (each logs to $OUT/balance_gpu.log and appends JSON rows, tagged "part", to
# $OUT/balance_gpu.jsonl; a failing part is logged and the others still run):
#   a  HF recipe (recipes/hf/finetune_tiny_lm.py), emulated vendors 1+1, no slow-down, 150
#      steps: per-step split, every step within one sample of 8:8?
#   b  hetccl bench straggler --device cuda, gaps 1 and 2: efficiency
#   c  GPT-2-small-shaped model (124M, bf16 autocast, DDP), GPU 1 emulated 2x and 3x slower:
#      balanced vs unbalanced efficiency, losses vs the homogeneous reference
#      (recipes/balance/gpt2_bench.py gaps)
#   d  same model, GPU 1 limited to 1/4 of the memory (set_per_process_memory_fraction): the
#      caps are measured, the plan respects them, efficiency (gpt2_bench.py memcap)
#   e  DeepSpeed ZeRO-2 (recipes/deepspeed/train.py) and the HF Trainer with a 2x gap:
#      solo throughput of each GPU, unbalanced and balanced runs, efficiency
#   f  pytest -m gpu tests/test_balance_gpu.py (event timing, GPU slow-down, no drift)
# Ends with a summary table (also $OUT/balance_gpu_summary.txt).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/balance_gpu}
DEVICE=${DEVICE:-cuda}
PARTS=${*:-a b c d e f}
mkdir -p "$OUT"
LOG="$OUT/balance_gpu.log"
JSONL="$OUT/balance_gpu.jsonl"
: > "$JSONL"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore TRANSFORMERS_VERBOSITY=error
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
SMOKE=0
if [ "$DEVICE" = cpu ]; then SMOKE=1; export OMP_NUM_THREADS=1; fi
# GPUs on this machine: with one, the two solo runs of part e share GPU 0 one after the other
# (at once they would halve each other's throughput) instead of one per GPU
NGPU=0
if [ "$DEVICE" = cuda ]; then NGPU=$($PY -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0); fi

log() { echo "$@" | tee -a "$LOG"; }
# run PART LIMIT_S cmd...: runs with a time limit, output to the log (tail shown), never aborts
run() {
  local part=$1 limit=$2; shift 2
  log "== [$part] $(date +%T) $*"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  log "== [$part] rc=$rc in $((SECONDS - t0)) s"
  echo "{\"part\": \"$part-status\", \"command\": \"$*\", \"rc\": $rc, \"seconds\": $((SECONDS - t0))}" >> "$JSONL"
  return $rc
}
# tag JSON rows of FILE with part PART and append them to $JSONL
collect() {
  [ -f "$2" ] || return 0
  $PY - "$1" "$2" "$JSONL" <<'EOF'
import json, sys
part, src, dst = sys.argv[1:]
with open(dst, "a") as out:
    for line in open(src):
        if line.strip():
            out.write(json.dumps({"part": part, **json.loads(line)}) + "\n")
EOF
}

log "== balance_gpu.sh $(date -Is) DEVICE=$DEVICE parts: $PARTS  out: $OUT"
if ! $PY -c "import hetccl._C" >/dev/null 2>&1 || [ "${REBUILD:-0}" = 1 ]; then
  log "== building hetccl (pip install --no-build-isolation --no-deps -e .)"
  $PY -m pip install -q --no-build-isolation --no-deps -e . >>"$LOG" 2>&1 || log "== build failed"
fi
$PY - <<'EOF' 2>&1 | tee -a "$LOG"
import torch
print(f"== torch {torch.__version__}, {torch.cuda.device_count()} GPUs"
      + (f": {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""))
try:
    import hetccl
    print(f"== hetccl {hetccl.__version__} from {hetccl.__file__}")
except Exception as e:  # noqa: BLE001
    print(f"== hetccl NOT importable: {e} (pip install --no-build-isolation -e .)")
EOF
if [ "$DEVICE" = cuda ]; then nvidia-smi -L 2>&1 | tee -a "$LOG"; fi

for part in $PARTS; do
case $part in
# ------------------------------------------------------------------------------------------
a)
  if [ $SMOKE = 1 ]; then A_ARGS=(--steps 20 --samples 512 --seq 48); else A_ARGS=(--steps 150); fi
  run a 150 $PY recipes/hf/finetune_tiny_lm.py --vendors 1+1 --no-reference --no-progress \
      --out "$OUT/a_hf_even" "${A_ARGS[@]}"
  $PY - "$OUT/a_hf_even/metrics.json" "$JSONL" <<'EOF' 2>&1 | tee -a "$LOG"
import json, statistics, sys
src, dst = sys.argv[1:]
try:
    m = json.load(open(src))
except FileNotFoundError:
    sys.exit("[a] no metrics.json")
run = m["runs"]["mixed 1+1"]
counts, B = run["counts"], m["config"]["global_batch"]
even = B // len(counts[0])
worst = max(abs(c - even) for step in counts for c in step)
times = run.get("step_times") or []
row = {"part": "a", "what": "HF recipe, vendors 1+1, no slow-down", "steps": len(counts),
       "global_batch": B, "counts_per_step": counts, "max_dev_from_even": worst,
       "within_one_sample_every_step": worst <= 1,
       "splits_seen": sorted({tuple(c) for c in counts}),
       "median_step_ms": 1e3 * statistics.median(times[5:]) if len(times) > 5 else None,
       "loss_first": run["losses"][0], "loss_last": run["losses"][-1]}
open(dst, "a").write(json.dumps(row) + "\n")
print(f"[a] {len(counts)} steps, splits seen {row['splits_seen']}, max deviation from "
      f"{even}:{even} = {worst} sample(s) -> within one sample every step: {worst <= 1}")
EOF
  ;;
# ------------------------------------------------------------------------------------------
b)
  if [ $SMOKE = 1 ]; then
    B_ARGS=(--device cpu --gaps 1,2 --steps 4 --warmup 6 --per-sample-ms 2)
  else
    B_ARGS=(--device cuda --gaps 1,2)
  fi
  run b 150 $PY -m hetccl.cli bench straggler --world 2 "${B_ARGS[@]}" --jsonl "$OUT/b_straggler.jsonl"
  collect b "$OUT/b_straggler.jsonl"
  ;;
# ------------------------------------------------------------------------------------------
c)
  if [ $SMOKE = 1 ]; then C_ARGS=(--device cpu --smoke --steps 4 --warmup 6); else C_ARGS=(--device cuda); fi
  run c 240 $PY recipes/balance/gpt2_bench.py gaps --gaps 2,3 "${C_ARGS[@]}" --jsonl "$OUT/c_gpt2_gaps.jsonl"
  collect c "$OUT/c_gpt2_gaps.jsonl"
  ;;
# ------------------------------------------------------------------------------------------
d)
  if [ $SMOKE = 1 ]; then D_ARGS=(--device cpu --smoke --steps 4 --warmup 6); else D_ARGS=(--device cuda); fi
  run d 150 $PY recipes/balance/gpt2_bench.py memcap --mem-fraction 0.25 "${D_ARGS[@]}" \
      --jsonl "$OUT/d_gpt2_memcap.jsonl"
  collect d "$OUT/d_gpt2_memcap.jsonl"
  ;;
# ------------------------------------------------------------------------------------------
e)
  # e1: DeepSpeed ZeRO-2, GPU 1 emulated 2x slower (forward by 1 + 3 (f - 1): ZeRO-2 reduces
  # gradients inside backward, which must not be stretched)
  if ! $PY -c "import deepspeed" >/dev/null 2>&1; then
    log "== [e] installing deepspeed from .whl/ (offline)"
    DS_BUILD_OPS=0 $PY -m pip install -q --no-index --find-links .whl deepspeed >>"$LOG" 2>&1 \
      || log "== [e] deepspeed install failed (carry .whl: bash recipes/fetch_gpu_wheels.sh)"
  fi
  if [ $SMOKE = 1 ]; then
    export DS_ACCELERATOR=cpu
    DSCFG=recipes/deepspeed/zero2.json; DSMODEL=recipes/deepspeed/model_tiny.json; DSSTEPS=8; DSWARM=3
    DSCAP=16
  else
    unset DS_ACCELERATOR
    # 117M-parameter GPT, 32 x 512 tokens per GPU and pass: compute, not the per-pass
    # gradient reduction, dominates a step (recipes/balance/ds_*.json)
    DSCFG=recipes/balance/ds_zero2_gpu.json; DSMODEL=recipes/balance/ds_model_gpu.json; DSSTEPS=30; DSWARM=10
    DSCAP=64     # one pass per step (lockstep), so the fast GPU's pass must hold its share
  fi
  DS=(recipes/deepspeed/train.py --deepspeed_config "$DSCFG" --model_config "$DSMODEL"
      --steps $DSSTEPS --warmup $DSWARM --comm_backend hetccl --out "$OUT/e_deepspeed.jsonl")
  TR=($PY -m torch.distributed.run --standalone)
  : > "$OUT/e_deepspeed.jsonl"
  if [ $SMOKE = 1 ] || [ "$NGPU" -lt 2 ]; then
    run e 200 "${TR[@]}" --nproc_per_node 1 "${DS[@]}" --tag solo-f1 --hetccl_slowdown 1
    run e 200 "${TR[@]}" --nproc_per_node 1 "${DS[@]}" --tag solo-f2 --hetccl_slowdown 2
  else   # the two solo runs at once, one per GPU
    (CUDA_VISIBLE_DEVICES=0 run e 200 "${TR[@]}" --nproc_per_node 1 "${DS[@]}" --tag solo-f1 \
        --hetccl_slowdown 1) &
    (CUDA_VISIBLE_DEVICES=1 run e 200 "${TR[@]}" --nproc_per_node 1 "${DS[@]}" --tag solo-f2 \
        --hetccl_slowdown 2) &
    wait
  fi
  # two ranks: DeepSpeed binds LOCAL_RANK to a GPU index, so with fewer GPUs than ranks the
  # workers start through `hetccl run` (torchrun's options), which shows each rank the GPU
  # local_rank % device_count as its GPU 0
  TR2=("${TR[@]}")
  if [ $SMOKE = 0 ] && [ "$NGPU" -lt 2 ]; then TR2=($PY -m hetccl.cli run --standalone); fi
  run e 200 "${TR2[@]}" --nproc_per_node 2 "${DS[@]}" --tag unbalanced --hetccl_vendors 1+1 \
      --hetccl_slowdown 1,2
  run e 200 "${TR2[@]}" --nproc_per_node 2 "${DS[@]}" --tag balanced --hetccl_vendors 1+1 \
      --hetccl_slowdown 1,2 --balance auto --max_micro $DSCAP
  $PY - "$OUT/e_deepspeed.jsonl" "$JSONL" $DSWARM <<'EOF' 2>&1 | tee -a "$LOG"
import json, statistics, sys
src, dst, warm = sys.argv[1], sys.argv[2], int(sys.argv[3])
runs = {}
for line in open(src):
    r = json.loads(line)
    runs.setdefault(r["tag"], []).append(r)
def thr(tag):
    rs = runs.get(tag, [])[warm:]
    return rs[0]["global_batch"] / statistics.median(r["step_time_s"] for r in rs) if rs else None
solo = [thr("solo-f1"), thr("solo-f2")]
out = open(dst, "a")
for tag in ("unbalanced", "balanced"):
    t = thr(tag)
    if t is None or None in solo:
        print(f"[e] DeepSpeed {tag}: missing runs ({sorted(runs)})")
        continue
    rs = runs[tag]
    row = {"part": "e-deepspeed", "mode": tag, "zero_stage": rs[-1]["zero_stage"],
           "throughput": t, "solo_throughput": solo, "efficiency": t / sum(solo),
           "samples_per_rank_last": rs[-1].get("samples_per_rank"),
           "micro_per_rank_last": rs[-1]["micro_per_rank"],
           "samples_per_rank_per_step": [r.get("samples_per_rank") for r in rs],
           "loss_first": rs[0]["loss"], "loss_last": rs[-1]["loss"],
           "max_abs_loss_diff_vs_unbalanced": max(abs(a["loss"] - b["loss"]) for a, b in
                                                   zip(rs, runs["unbalanced"]))}
    out.write(json.dumps(row) + "\n")
    print(f"[e] DeepSpeed ZeRO-{row['zero_stage']} {tag:10s}: {t:8.1f} samples/s, solo sum "
          f"{sum(solo):8.1f}, efficiency {100 * row['efficiency']:5.1f}%, split "
          f"{row['samples_per_rank_last']}")
EOF
  unset DS_ACCELERATOR
  # e2: HF Trainer, GPU 1 emulated 2x slower (forward and backward), a model large enough for
  # the GPUs to be busy
  if [ $SMOKE = 1 ]; then
    HF=(--steps 12 --samples 512 --seq 48)
  else
    HF=(--steps 40 --layers 8 --hidden 1024 --lr 3e-4 --global-batch 128 --grad-accum 4
        --max-micro 64)
  fi
  HFR=($PY recipes/hf/finetune_tiny_lm.py --no-reference --no-progress "${HF[@]}")
  if [ $SMOKE = 1 ] || [ "$NGPU" -lt 2 ]; then
    run e 200 "${HFR[@]}" --out "$OUT/e_hf_solo-f1" --vendors 1 --slowdown 1
    run e 200 "${HFR[@]}" --out "$OUT/e_hf_solo-f2" --vendors 1 --slowdown 2
  else
    (CUDA_VISIBLE_DEVICES=0 run e 200 "${HFR[@]}" --out "$OUT/e_hf_solo-f1" --vendors 1 \
        --slowdown 1) &
    (CUDA_VISIBLE_DEVICES=1 run e 200 "${HFR[@]}" --out "$OUT/e_hf_solo-f2" --vendors 1 \
        --slowdown 2) &
    wait
  fi
  run e 200 "${HFR[@]}" --out "$OUT/e_hf_unbalanced" --vendors 1+1 --slowdown 1,2 --no-replan
  run e 200 "${HFR[@]}" --out "$OUT/e_hf_balanced" --vendors 1+1 --slowdown 1,2
  $PY - "$OUT" "$JSONL" <<'EOF' 2>&1 | tee -a "$LOG"
import json, statistics, sys
out_dir, dst = sys.argv[1:]
def load(tag):
    try:
        m = json.load(open(f"{out_dir}/e_hf_{tag}/metrics.json"))
    except FileNotFoundError:
        return None, None
    run = next(iter(m["runs"].values()))
    t = run["step_times"][12:] or run["step_times"]
    return m["config"]["global_batch"] / statistics.median(t), run
solo = [load("solo-f1")[0], load("solo-f2")[0]]
unb = load("unbalanced")[1]
for tag in ("unbalanced", "balanced"):
    thr, run = load(tag)
    if thr is None or None in solo:
        print(f"[e] HF Trainer {tag}: missing runs")
        continue
    row = {"part": "e-hf-trainer", "mode": tag, "throughput": thr, "solo_throughput": solo,
           "efficiency": thr / sum(solo), "counts_last": run["counts"][-1],
           "counts_per_step": run["counts"], "loss_first": run["losses"][0],
           "loss_last": run["losses"][-1],
           "max_rel_loss_diff_vs_unbalanced": None if unb is None else max(
               abs(a - b) / abs(b) for a, b in zip(run["losses"], unb["losses"]))}
    open(dst, "a").write(json.dumps(row) + "\n")
    print(f"[e] HF Trainer {tag:10s}: {thr:8.1f} samples/s, solo sum {sum(solo):8.1f}, "
          f"efficiency {100 * row['efficiency']:5.1f}%, split {row['counts_last']}")
EOF
  ;;
# ------------------------------------------------------------------------------------------
f)
  run f 150 $PY -m pytest -q -p no:cacheprovider tests/test_balance_gpu.py -m gpu -rs
  ;;
*) log "== unknown part $part (a b c d e f)";;
esac
done

# ------------------------------------------------------------------------------------------
$PY - "$JSONL" <<'EOF' 2>&1 | tee "$OUT/balance_gpu_summary.txt" | tee -a "$LOG"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print("\n==== summary (raw rows: balance_gpu.jsonl) ====")
for r in rows:
    p = r["part"]
    if p.endswith("-status"):
        if r["rc"]:
            print(f"  FAILED  {p[:-7]}: rc={r['rc']} after {r['seconds']} s: {r['command'][:90]}")
        continue
    if p == "a":
        print(f"  a  HF recipe 1+1, no slow-down, {r['steps']} steps: max deviation from even "
              f"{r['max_dev_from_even']} sample(s), splits {r['splits_seen']}")
    elif p == "b":
        print(f"  b  straggler {r['device']} gap {r['gap']:g} {r['mode']:10s}: efficiency "
              f"{100 * r['efficiency']:5.1f}%  plan {r['plan_samples']}")
    elif p in ("c", "d"):
        eff = f"{100 * r['efficiency']:5.1f}%" if "efficiency" in r else "   -  "
        dl = r.get("max_rel_loss_diff_vs_reference")
        print(f"  {p}  GPT-2 {r['mode']:17s} gap {r['gap']:g}: efficiency {eff}  plan "
              f"{r['plans'][-1]}" + (f"  caps {r['caps']}" if "caps" in r else "")
              + (f"  max rel loss diff vs ref {dl:.2e}" if dl is not None else ""))
    elif p.startswith("e-"):
        print(f"  e  {p[2:]:12s} {r['mode']:10s}: efficiency {100 * r['efficiency']:5.1f}%")
EOF
log "== done $(date +%T); results in $OUT"
