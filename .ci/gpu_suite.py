"""Helpers of .ci/gpu-box.sh's tests step (run on the GPU box).

    python3 .ci/gpu_suite.py wheels [DIR]          # the carried wheels the box lacks
    python3 .ci/gpu_suite.py summary OUT RC SECS LIMIT   # OUT/gpu_summary.txt's text
    python3 .ci/gpu_suite.py fingerprint           # the source tree's fingerprint

wheels: one wheel per distribution of DIR (default .whl), the highest version of each, leaving
out every distribution the box already has (importlib.metadata finds it) and torch, numpy,
triton, nvidia-* and libucx whatever is installed: a wheel installed with --target onto
PYTHONPATH would shadow the box's copy, and the box's torch must keep its own dependencies.
fingerprint: sha1 over the paths and contents of the tracked-kind source files (hetccl/,
csrc/, integrations/, tests/, .ci/, CMakeLists.txt, pyproject.toml): the device tool sends a
copy of the working tree whose git metadata may be older than the tree, so the summary names
both, and `fingerprint` run here says which commit a summary was made from.
summary: counts and wall time of the pytest run in OUT/gpu_tests.log, its failures and skips,
and the figure rows of OUT/gpu_figures.jsonl (written by tests/test_gpu_suite.py) as a table.
"""
from __future__ import annotations

import glob
import importlib.metadata as md
import json
import os
import re
import subprocess
import sys

NEVER = ("torch", "numpy", "triton", "libucx-cu13")


def _version_key(path: str):
    v = os.path.basename(path).split("-")[1]
    return [int(x) if x.isdigit() else x for x in re.split(r"[.+]", v)]


def wheels(folder: str = ".whl") -> list[str]:
    best: dict[str, str] = {}
    for w in glob.glob(os.path.join(folder, "*.whl")):
        name = re.sub(r"[-_.]+", "-", os.path.basename(w).split("-")[0]).lower()
        if name in NEVER or name.startswith("nvidia-"):
            continue
        try:
            md.version(name)
            continue  # the box has it: keep the box's
        except md.PackageNotFoundError:
            pass
        if name not in best or _version_key(w) > _version_key(best[name]):
            best[name] = w
    return sorted(best.values())


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return str(v)


SOURCE = ("hetccl", "csrc", "integrations", "tests", ".ci", "CMakeLists.txt", "pyproject.toml")


def fingerprint(root: str = ".") -> str:
    import hashlib
    h = hashlib.sha1()
    paths = []
    for top in SOURCE:
        full = os.path.join(root, top)
        if os.path.isfile(full):
            paths.append(top)
        for d, dirs, files in os.walk(full):
            dirs[:] = sorted(x for x in dirs if x != "__pycache__" and not x.startswith("."))
            paths += [os.path.relpath(os.path.join(d, f), root) for f in files
                      if f.endswith((".py", ".cc", ".h", ".sh", ".txt", ".toml", ".cmake"))
                      or f == "run" or f == "setup"]
    for rel in sorted(set(paths)):
        h.update(rel.encode() + b"\0" + open(os.path.join(root, rel), "rb").read() + b"\0")
    return h.hexdigest()[:12]


def summary(out: str, rc: int, secs: int, limit: str) -> str:
    lines = []
    log_path = os.path.join(out, "gpu_tests.log")
    log = open(log_path, errors="replace").read() if os.path.exists(log_path) else ""
    try:
        import torch
        gpu = (f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, "
               f"torch {torch.__version__}") if torch.cuda.is_available() else \
            f"no CUDA, torch {torch.__version__}"
    except Exception as e:  # noqa: BLE001
        gpu = f"torch not importable ({e})"
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True).stdout.strip()
    date = subprocess.run(["date", "-u", "+%Y-%m-%d %H:%M UTC"], capture_output=True,
                          text=True).stdout.strip()
    lines.append(f"GPU suite, {date}, commit {rev or '?'} (git metadata of the copy), source "
                 f"fingerprint {fingerprint()} (.ci/gpu_suite.py fingerprint), {gpu}")
    # the pytest command line the tests step ran (.ci/gpu-box.sh exports it)
    lines.append("command: bash .ci/gpu-box.sh build tests   ("
                 + os.environ.get("GPU_SUITE_PYTEST", "python3 -m pytest tests/test_gpu*.py -m gpu")
                 + ")")
    last = next((l for l in reversed(log.splitlines()) if re.search(r"\d+ (passed|failed)", l)),
                "")
    counts = re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)", last)
    status = f"TIMED OUT (limit {limit} s)" if rc in (124, 137) else f"pytest exit {rc}"
    lines.append(f"result: {', '.join(f'{n} {w}' for n, w in counts) or 'no pytest summary line'}"
                 f"; {secs} s wall; {status}")
    fails = [l for l in log.splitlines() if l.startswith(("FAILED ", "ERROR "))]
    skips = [l for l in log.splitlines() if l.startswith("SKIPPED ")]
    lines += ["  " + l[:220] for l in fails[:40]]
    lines += ["  " + l[:220] for l in skips[:12]]
    fig_path = os.path.join(out, "gpu_figures.jsonl")
    rows = [json.loads(l) for l in open(fig_path) if l.strip()] if os.path.exists(fig_path) else []
    if rows:
        lines.append("figures (correctness runs on this box, not speed claims):")
    for r in rows:
        name = r.pop("figure")
        r.pop("device", None)
        vals = ", ".join(f"{k} {_fmt(v)}" for k, v in r.items())
        lines.append(f"  {name:28s} {vals}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv and argv[0] == "fingerprint":
        print(fingerprint())
        return 0
    if argv and argv[0] == "wheels":
        print(" ".join(wheels(*argv[1:2])))
        return 0
    if argv and argv[0] == "summary" and len(argv) == 5:
        print(summary(argv[1], int(argv[2]), int(argv[3]), argv[4]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
