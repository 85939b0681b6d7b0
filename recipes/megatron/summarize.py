"""Summary of `hetccl megatron` JSON rows grouped by tag (recipes/megatron/gpu.sh, CPU figures).

    python recipes/megatron/summarize.py rows.jsonl [--warm N]

Per tag: iterations, median ms per iteration after the warm-up (default: the first third of the
iterations, at least 1), samples/s, median TFLOP/s per GPU, first and last lm loss, the stage
split. Then the comparisons the tags allow: pp=2 planned split against the even one (throughput
ratio; 1.5x is the ideal for a 2x slower second GPU), pp=1 data parallelism with the balancer
against without, hetccl against the reference backend (time ratio), and the largest loss
difference of runs that train the same model on the same data.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys


def load(path: str) -> tuple[dict[str, list[dict]], list[dict]]:
    runs: dict[str, list[dict]] = {}
    status = []
    for line in open(path):
        if not line.strip():
            continue
        r = json.loads(line)
        tag = r.get("tag") or "untagged"
        if tag.endswith("-status"):
            status.append(r)
            continue
        runs.setdefault(tag, []).append(r)
    return runs, status


def stats(rows: list[dict], warm: int | None) -> dict:
    w = warm if warm is not None else max(1, len(rows) // 3)
    body = rows[w:] or rows
    ms = statistics.median(r["ms_per_iteration"] for r in body)
    return dict(iters=len(rows), ms=ms, samples_s=rows[-1]["global_batch"] / ms * 1e3,
                tflops=statistics.median(r["tflops_per_gpu"] for r in body),
                first=rows[0]["lm_loss"], last=rows[-1]["lm_loss"], stages=rows[0].get("stages"),
                micro=rows[-1].get("micro_batches"), backend=rows[0]["backend"],
                world=rows[0]["world"], pp=rows[0]["pp"], dp=rows[0]["dp"],
                plan=rows[0].get("stage_plan"), device=rows[0]["device"],
                params=rows[0].get("params"))


def max_loss_diff(a: list[dict], b: list[dict]) -> float:
    return max((abs(x["lm_loss"] - y["lm_loss"]) / abs(y["lm_loss"]) for x, y in zip(a, b)),
               default=float("nan"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("rows")
    ap.add_argument("--warm", type=int, default=None)
    a = ap.parse_args(argv)
    runs, status = load(a.rows)
    print("==== megatron-core over hetccl: summary (raw rows: megatron_rows.jsonl) ====")
    for s in status:
        if s["rc"]:
            print(f"  FAILED {s['tag'][:-7]}: rc={s['rc']} after {s['seconds']} s")
    S = {t: stats(rs, a.warm) for t, rs in runs.items()}
    print(f"{'tag':24s} {'iters':>5s} {'ms/iter':>9s} {'samples/s':>10s} {'TFLOP/s/GPU':>12s} "
          f"{'loss first':>10s} {'last':>8s}  split / micro-batches")
    for t, s in S.items():
        split = f"stages {s['stages']}" if s["pp"] > 1 else f"micro {s['micro']}"
        print(f"{t:24s} {s['iters']:5d} {s['ms']:9.1f} {s['samples_s']:10.2f} {s['tflops']:12.3g} "
              f"{s['first']:10.4f} {s['last']:8.4f}  {split} ({s['backend']}, {s['device']}, "
              f"world {s['world']}, pp {s['pp']}, dp {s['dp']})")
        if s["plan"]:
            p = s["plan"]
            print(f"{'':24s} planner: measured per-layer ms by stage "
                  f"{[round(x, 3) for x in p['stage_layer_ms']]}, head {p['head_ms']:.3g} ms; "
                  f"{p['describe']}")

    def ratio(fast: str, slow: str, what: str, ideal: str = "") -> None:
        if fast in S and slow in S:
            r = S[fast]["samples_s"] / S[slow]["samples_s"]
            d = max_loss_diff(runs[fast], runs[slow])
            print(f"  {what}: {r:.3f}x throughput{ideal}; max relative loss difference "
                  f"{d:.2e}")
    print("comparisons:")
    ratio("a-pp2-plan", "a-pp2-even", "pp=2, 2nd GPU 2x slower: planned split vs even split",
          " (ideal 1.5x)")
    ratio("a-pp1-dp-balanced", "a-pp1-dp-even", "pp=1 dp=2, 2nd GPU 2x slower: balancer vs "
          "equal micro-batches")
    ratio("a-pp2-plan", "a-pp1-dp-balanced", "pp=2 planned vs pp=1 dp balanced")
    ratio("b-hetccl-1p1", "b-nccl", "realistic recipe, hetccl 1+1 vs reference backend")
    for x, y in (("a1gpu-pp2-even", "a1gpu-pp1-reference"),
                 ("a1gpu-pp2-uneven", "a1gpu-pp1-reference")):
        if x in runs and y in runs:
            print(f"  {x} vs {y} (correctness, both stages on one GPU, NOT a speed figure): "
                  f"max relative loss difference {max_loss_diff(runs[x], runs[y]):.2e} over "
                  f"{min(len(runs[x]), len(runs[y]))} iterations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
