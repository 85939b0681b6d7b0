"""Runs PyTorch's own distributed test suite against a backend: gloo, or hetccl with emulated
vendors.

The suite is torch/testing/_internal/distributed/distributed_test.py, which ships inside the
torch wheel. It is run the way pytorch's test/distributed/test_distributed_spawn.py runs it
(TestDistBackend + DistributedTest._DistTestBase, one process per rank started with
multiprocessing spawn, file:// rendezvous, BACKEND/WORLD_SIZE/TEMP_DIR in the environment), with
"hetccl" registered as a plugin backend the way torch_ucc's test/torch_tests.py registers "ucc"
(import the package, add the name to DistTestCases' feature sets).

    python tests/torch_suite.py --backend gloo --world-size 2
    python tests/torch_suite.py --backend hetccl --vendors 2+1 --json out.json
    python tests/torch_suite.py --backend hetccl --vendors 1+1 -k all_reduce -k barrier

Gates on the name "gloo". The suite enables many CPU tests only for BACKEND == "gloo" (timeouts,
sparse all-reduce, batch_isend_irecv on CPU, DDP get_future, monitored_barrier, ...), both in
decorators evaluated at import and in `if BACKEND == "gloo"` branches inside test bodies. For
hetccl this runner treats hetccl like gloo for those gates, and only for them:

  * the suite module is imported with BACKEND=gloo, so every skip decision taken at import is
    exactly gloo's (hetccl runs the very selection gloo runs);
  * afterwards the module's BACKEND is a `GlooGate("hetccl")`: a str equal to "hetccl" that also
    compares equal to "gloo", so runtime name checks take gloo's branch, while everything that
    uses the value (init_process_group(backend=BACKEND), dist.Backend(BACKEND), the expected
    result of dist.get_backend()) sees "hetccl";
  * DistTestCases' feature sets that contain gloo get hetccl too, plus "plugin";
  * torch's dist.monitored_barrier refuses every backend not named gloo (a check in torch, not a
    name gate of the suite), so the suite's monitored_barrier tests call
    hetccl.monitored_barrier, the documented equivalent (docs/torch-suite.md).

Vendor emulation: --vendors 2+1 sets HETCCL_VENDOR_SPLIT in every rank; the suite passes the rank
to init_process_group (no RANK variable), which is the case hetccl's split must handle.

Output: one line per test (PASS/FAIL/ERROR/SKIP) and, with --json, a file
{"backend", "vendors", "world_size", "torch", "results": {test: {"outcome", "detail"}}}.
Exit status 0 when no test failed or errored.

This file is both the runner (__main__) and the module the rank processes import (multiprocessing
spawn re-imports the main module): the suite class is built at import when TORCH_SUITE_BACKEND
names the backend, which main() sets before the first test starts.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import unittest

SUITE_ENV = "TORCH_SUITE_BACKEND"
START_ENV = "TORCH_SUITE_START_METHOD"
RANK_ENV_FLAG = "TORCH_SUITE_SET_RANK_ENV"
SUITE_MODULE = "torch.testing._internal.distributed.distributed_test"


def missing_dependencies() -> str | None:
    """Why the suite cannot run here, or None. Checked without importing the suite module (it
    needs BACKEND/WORLD_SIZE set and imports much of torch's test tooling)."""
    import importlib.util

    try:
        import torch.distributed as dist
    except ImportError as e:  # pragma: no cover - torch is a hard dependency of hetccl
        return f"torch.distributed cannot be imported ({e})"
    if not dist.is_available():
        return "this torch build has no torch.distributed"
    if not dist.is_gloo_available():
        return "this torch build has no gloo backend"
    for mod in ("expecttest", "numpy"):  # imported by torch's test tooling (common_utils)
        if importlib.util.find_spec(mod) is None:
            return (f"torch's test tooling needs the {mod!r} module "
                    f"(pip install {mod}; hetccl's [test] extra has it)")
    try:
        spec = importlib.util.find_spec(SUITE_MODULE)
    except ModuleNotFoundError:
        spec = None
    if spec is None:
        return (f"{SUITE_MODULE} is not shipped with this torch build "
                "(torch.testing._internal is part of the regular wheels)")
    return None


class GlooGate(str):
    """The suite's BACKEND for hetccl: equal to "hetccl" and also to "gloo", so that the suite's
    name gates (`BACKEND == "gloo"`, `BACKEND != "gloo"`) treat hetccl like gloo. Its value,
    str() and lower() are "hetccl"."""

    def __eq__(self, other):
        return str.__eq__(self, other) or other == "gloo"

    def __ne__(self, other):
        return not self.__eq__(other)

    __hash__ = str.__hash__


def _build_suite_class():
    backend = os.environ[SUITE_ENV]
    import torch
    import torch.distributed as dist  # noqa: F401
    from torch.testing._internal.common_distributed import DistTestCases

    if backend == "hetccl":
        import hetccl  # noqa: F401 - registers the plugin backend "hetccl"

        for table in (DistTestCases.skip_collective, DistTestCases.backend_feature):
            for names in table.values():
                if "gloo" in names:
                    names.add("hetccl")
        DistTestCases.backend_feature["plugin"].add("hetccl")
        os.environ["BACKEND"] = "gloo"  # skip decisions taken at import: exactly gloo's
    else:
        os.environ["BACKEND"] = backend
    import importlib

    dt = importlib.import_module(SUITE_MODULE)
    os.environ["BACKEND"] = backend
    if backend == "hetccl":
        import hetccl

        dt.BACKEND = GlooGate("hetccl")
        if hasattr(hetccl, "monitored_barrier"):  # absent in hetccl before issue 15
            dt.dist = _MonitoredBarrierRouting(dt.dist, hetccl.monitored_barrier)

    start_method = os.environ.get(START_ENV, "forkserver")

    class TestDistBackendWithSpawn(dt.TestDistBackend, dt.DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            self._spawn_processes()
            torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()

        if start_method == "forkserver":
            # Ranks fork from a server process that imported this module (and so torch and the
            # suite) once, instead of a fresh interpreter per rank: the same isolation from the
            # test process (the server never ran a test), several times faster. The test
            # process's environment at start time travels with each rank, as with spawn (the
            # suite sets TEMP_DIR/INIT_METHOD per test in the parent).
            def _spawn_processes(self):
                ctx = torch.multiprocessing.get_context("forkserver")
                # by import name: Python 3.11's forkserver ignores a "__main__" preload
                ctx.set_forkserver_preload([os.path.splitext(os.path.basename(__file__))[0]])
                self._start_processes(ctx.Process)

            def _start_processes(self, proc):
                self.processes = []
                env = dict(os.environ)
                for rank in range(int(self.world_size)):
                    parent_conn, child_conn = torch.multiprocessing.Pipe()
                    process = proc(target=self.__class__._run, name=f"process {rank}",
                                   args=(rank, self._current_test_name(), self.file_name,
                                         child_conn),
                                   kwargs={"fake_pg": getattr(self, "fake_pg", False),
                                           "_hetccl_env": env})
                    process.start()
                    self.pid_to_pipe[process.pid] = parent_conn
                    self.processes.append(process)

            @classmethod
            def _run(cls, rank, test_name, file_name, pipe, _hetccl_env=None, **kwargs):
                if _hetccl_env is not None:
                    os.environ.clear()
                    os.environ.update(_hetccl_env)
                    # a spawned rank reads INIT_METHOD when it imports the suite, i.e. the value
                    # the test process set for this test (setUp makes a fresh one per test)
                    dt.INIT_METHOD = os.environ.get("INIT_METHOD", "env://")
                if os.environ.get(RANK_ENV_FLAG) == "1":
                    os.environ["RANK"] = str(rank)
                return super()._run(rank, test_name, file_name, pipe, **kwargs)

    name = f"TestDistBackendWithSpawn{backend.upper()}"
    TestDistBackendWithSpawn.__name__ = TestDistBackendWithSpawn.__qualname__ = name
    globals()[name] = TestDistBackendWithSpawn
    return TestDistBackendWithSpawn


class _MonitoredBarrierRouting:
    """torch.distributed as the suite module sees it, except that monitored_barrier is
    hetccl.monitored_barrier (torch's own refuses backends not named gloo)."""

    def __init__(self, dist, monitored_barrier):
        self._dist = dist
        self.monitored_barrier = monitored_barrier

    def __getattr__(self, name):
        return getattr(self._dist, name)


if os.environ.get(SUITE_ENV):  # a rank process (spawn re-imports this module), or main() below
    _SUITE_CLASS = _build_suite_class()


# ------------------------------------------------------------------------------- running
class _Recorder(unittest.TextTestResult):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.outcomes: dict[str, dict] = {}
        self._t0 = 0.0

    def _put(self, test, outcome, detail=""):
        name = test.id().split(".")[-1]
        self.outcomes[name] = {"outcome": outcome, "detail": detail[-4000:],
                               "seconds": round(time.monotonic() - self._t0, 2)}
        print(f"{outcome:<5} {name} ({self.outcomes[name]['seconds']} s)"
              + (f": {detail.strip().splitlines()[-1][:200]}" if detail and outcome != "PASS"
                 else ""), flush=True)

    def startTest(self, test):
        self._t0 = time.monotonic()
        unittest.TestResult.startTest(self, test)

    def addSuccess(self, test):
        self._put(test, "PASS")

    def addFailure(self, test, err):
        unittest.TestResult.addFailure(self, test, err)
        self._put(test, "FAIL", self._exc_info_to_string(err, test))

    def addError(self, test, err):
        unittest.TestResult.addError(self, test, err)
        self._put(test, "ERROR", self._exc_info_to_string(err, test))

    def addSkip(self, test, reason):
        self._put(test, "SKIP", str(reason))

    def addExpectedFailure(self, test, err):
        self._put(test, "PASS", "expected failure")

    def addUnexpectedSuccess(self, test):
        unittest.TestResult.addUnexpectedSuccess(self, test)
        self._put(test, "FAIL", "unexpected success")


def select(names: list[str], patterns: list[str], exact: list[str]) -> list[str]:
    if exact:
        unknown = sorted(set(exact) - set(names))
        if unknown:
            raise SystemExit(f"torch_suite: no such test(s) in the suite: {unknown}")
        return [n for n in names if n in set(exact)]
    if patterns:
        return [n for n in names if any(p in n for p in patterns)]
    return names


def outcomes(path: str) -> dict[str, str]:
    with open(path) as f:
        return {t: r["outcome"] for t, r in json.load(f)["results"].items()}


def regressions(gloo: dict[str, str], hetccl: dict[str, str]) -> list[str]:
    """Tests that pass on gloo and do not pass on hetccl."""
    return sorted(t for t, o in gloo.items() if o == "PASS" and hetccl.get(t) != "PASS")


def report(paths: list[str]) -> str:
    """A markdown table of the runs in `paths` (JSON files of main(--json)), with, for each
    hetccl run, the tests that pass on the gloo run of the same world size and init method but
    not on hetccl."""
    runs = []
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        counts: dict[str, int] = {}
        for r in d["results"].values():
            counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
        runs.append((d, counts, {t: r["outcome"] for t, r in d["results"].items()}))
    lines = ["| backend | vendors | ranks | init | tests | pass | fail | error | skip | passes on "
             "gloo, not here | seconds |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for d, c, o in runs:
        ref = next((oo for dd, _, oo in runs if dd["backend"] == "gloo"
                    and dd["world_size"] == d["world_size"]
                    and dd.get("init_method") == d.get("init_method")), None)
        reg = "-" if d["backend"] == "gloo" or ref is None else (
            ", ".join(regressions(ref, o)) or "none")
        lines.append(f"| {d['backend']} | {d.get('vendors') or '-'} | {d['world_size']} | "
                     f"{d.get('init_method', 'env')} | {len(o)} | {c.get('PASS', 0)} | "
                     f"{c.get('FAIL', 0)} | {c.get('ERROR', 0)} | {c.get('SKIP', 0)} | {reg} | "
                     f"{d.get('seconds', '')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--report":
        print(report(sys.argv[2:]))
        return 0
    ap = argparse.ArgumentParser(
        prog="python tests/torch_suite.py",
        description=__doc__.split("\n\n")[0],
        epilog="python tests/torch_suite.py --report RUN.json ...: markdown table of runs")
    ap.add_argument("--backend", choices=["gloo", "hetccl"], required=True)
    ap.add_argument("--vendors", default=None,
                    help="hetccl only: emulated vendor split such as 1+1, 2+1, 1+1+1 "
                         "(sets HETCCL_VENDOR_SPLIT; the world size is its sum)")
    ap.add_argument("--world-size", type=int, default=None,
                    help="number of ranks (default: the split's sum, else 2)")
    ap.add_argument("-k", dest="patterns", action="append", default=[],
                    help="run tests whose name contains this (repeatable)")
    ap.add_argument("--tests", default="", help="comma-separated exact test names")
    ap.add_argument("--timeout", type=int, default=120,
                    help="seconds one test may take (torch's default is 300)")
    ap.add_argument("--json", default=None, help="write per-test outcomes here")
    ap.add_argument("--list", action="store_true", help="list the selected tests and exit")
    ap.add_argument("--init-method", choices=["env", "file"], default="env",
                    help="the suite's INIT_METHOD, as pytorch's run_test.py runs it twice: env:// "
                         "(default; class suffix NoInitFile upstream) or file:// (also runs the "
                         "tests that re-initialise from a file, e.g. test_barrier_timeout_global)")
    ap.add_argument("--set-rank-env", action="store_true",
                    help="export RANK in every rank process (forkserver only). Not how the suite "
                         "runs: for measuring hetccl versions from before issue 15, whose "
                         "HETCCL_VENDOR_SPLIT read RANK only (without it every rank became v0)")
    ap.add_argument("--start-method", choices=["forkserver", "spawn"], default="forkserver",
                    help="how rank processes start: spawn is exactly upstream's (a fresh "
                         "interpreter per rank, ~5-10 s per test); forkserver (default) forks "
                         "them from a server that imported the suite once")
    args = ap.parse_args(argv)

    why = missing_dependencies()
    if why:
        print(f"torch_suite: cannot run: {why}", file=sys.stderr)
        return 3
    world = args.world_size
    if args.vendors:
        if args.backend != "hetccl":
            raise SystemExit("torch_suite: --vendors applies to --backend hetccl only")
        from hetccl.launch import vendor_labels

        n = len(vendor_labels(args.vendors))
        if world is not None and world != n:
            raise SystemExit(f"torch_suite: --world-size {world} != sum of --vendors {args.vendors}")
        world = n
        os.environ["HETCCL_VENDOR_SPLIT"] = args.vendors
    world = world or 2
    os.environ["WORLD_SIZE"] = str(world)
    os.environ["DISTRIBUTED_TESTS_DEFAULT_TIMEOUT"] = str(args.timeout)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.pop("RANK", None)  # the suite passes ranks to init_process_group
    os.environ[SUITE_ENV] = args.backend
    if args.init_method == "file":
        import tempfile
        init_dir = tempfile.mkdtemp(prefix="torch_suite_init_")
        os.environ["INIT_METHOD"] = "file://" + os.path.join(init_dir, "shared_init_file")
    else:
        os.environ["INIT_METHOD"] = "env://"
    os.environ[START_ENV] = args.start_method
    if args.set_rank_env:
        if args.start_method != "forkserver":
            raise SystemExit("torch_suite: --set-rank-env needs --start-method forkserver")
        os.environ[RANK_ENV_FLAG] = "1"
    # the forkserver imports this file by name (its preload); Python 3.11 does not hand it our
    # sys.path, but it inherits the environment
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [here] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    cls = _build_suite_class()
    import torch

    loader = unittest.TestLoader()
    names = select(loader.getTestCaseNames(cls), args.patterns,
                   [t for t in args.tests.split(",") if t])
    if args.list:
        print("\n".join(names))
        return 0
    suite = unittest.TestSuite(cls(n) for n in names)
    runner = unittest.TextTestRunner(resultclass=_Recorder, verbosity=0, stream=sys.stderr)
    t0 = time.monotonic()
    result = runner.run(suite)
    counts: dict[str, int] = {}
    for o in result.outcomes.values():
        counts[o["outcome"]] = counts.get(o["outcome"], 0) + 1
    print(f"torch_suite: backend {args.backend} vendors {args.vendors or '-'} world {world} "
          f"init {args.init_method}: "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
          + f" ({time.monotonic() - t0:.0f} s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": args.backend, "vendors": args.vendors, "world_size": world,
                       "init_method": args.init_method, "start_method": args.start_method,
                       "torch": torch.__version__, "seconds": round(time.monotonic() - t0),
                       "results": result.outcomes}, f, indent=1, sort_keys=True)
    return 0 if not (counts.get("FAIL") or counts.get("ERROR")) else 1


if __name__ == "__main__":
    sys.exit(main())
