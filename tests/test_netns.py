"""Several hosts for real on one machine (hetccl/netns.py): network namespaces with their own
address, /dev/shm and hostname, torchrun across them with a c10d rendezvous on host 0, exactly as
on a cluster. Rank side: tests/netns_worker.py.

What is checked: the bridge chooses shm inside a host and tcp (or a forced UCX) between hosts
from what each rank sees (no HETCCL_EMULATE_HOSTS); every collective against float64 references
with vendors split across and inside hosts; faults (link down in the middle of a 64 MiB
all_reduce, a host SIGKILLed, a host SIGSTOPped, a host that never joins, delay/loss where the
kernel has netem) end on every surviving rank with an error that names the peer and its host
within the timeout, and nothing is left behind; torchrun's elastic restart resumes from a
checkpoint with exact parameters; a machine on the fabric that is not part of the job gets
nothing from the bridge listeners and disturbs nothing.

Skipped, with the reason, where namespaces cannot be created (not root, no iproute2). The
default suite runs the tcp/shm cases (about 2 minutes on 2 cores); UCX forced, the UCX security
case and the soak are `slow`: `python3 -m pytest -q -m slow tests/test_netns.py`.
"""
from __future__ import annotations

import glob
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from hetccl import netns

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "netns_worker.py")

_OK, _WHY = netns.available()
pytestmark = pytest.mark.skipif(not _OK, reason=f"network namespaces unavailable: {_WHY}")


def _free_port() -> int:
    # the port is on host 0's own address inside its namespace: nothing else listens there
    return 29400 + (os.getpid() % 500)


@pytest.fixture
def hosts2():
    h = netns.Hosts(2)
    yield h
    h.close()
    # everything is gone: no namespace of this run, no process of it
    names = netns._ip("netns", "list").stdout
    assert h.prefix not in names, names


def _env(vendors: str, **extra) -> dict:
    env = dict(os.environ, HETCCL_NETNS_VENDORS=vendors, PYTHONUNBUFFERED="1",
               TORCH_CPP_LOG_LEVEL="ERROR", HETCCL_LOG_LEVEL="WARNING")
    env.pop("HETCCL_EMULATE_HOSTS", None)
    env.pop("HETCCL_VENDOR_SPLIT", None)
    env.update(extra)
    return env


def _launch(h, scenario, out, args, vendors, nproc=2, max_restarts=0, only=None, **extra):
    procs = []
    for i in range(h.n):
        if only is not None and i not in only:
            continue
        log = open(os.path.join(out, f"host{i}.log"), "w")
        procs.append(h.torchrun(i, [WORKER, scenario, out, json.dumps(args)], nproc=nproc,
                                port=_free_port(), max_restarts=max_restarts,
                                join_timeout=args.get("join_timeout", 60),
                                env=_env(vendors[i], **extra), stdout=log,
                                stderr=subprocess.STDOUT))
    return procs


def _results(out, scenario, restart=None) -> dict[int, dict]:
    res = {}
    for f in glob.glob(os.path.join(out, f"{scenario}-r*-a*.json")):
        d = json.load(open(f))
        if restart is None or d["restart"] == restart:
            res[d["rank"]] = d
    return res


def _logs(out) -> str:
    return "\n".join(f"--- {p}\n" + open(p).read()[-3000:]
                     for p in sorted(glob.glob(os.path.join(out, "host*.log"))))


def _wait_results(out, scenario, n, timeout) -> dict[int, dict]:
    end = time.monotonic() + timeout
    while len(_results(out, scenario)) < n:
        assert time.monotonic() < end, f"{n} results not there after {timeout} s\n{_logs(out)}"
        time.sleep(0.1)
    time.sleep(0.5)
    return _results(out, scenario)


def _finish(procs, timeout, out):
    codes = netns.wait_all(procs, timeout)
    assert None not in codes, f"launchers still running after {timeout} s\n{_logs(out)}"
    return codes


# ---------------------------------------------------------------------- placement and choice
@pytest.mark.parametrize("layout,forced", [
    ("1+1 per host", "auto"), ("2+2 across", "auto"),
    pytest.param("1+1 per host", "ucx", marks=pytest.mark.slow)])
def test_collectives_across_hosts(hosts2, tmp_path, layout, forced):
    """Every collective of collective_cases against references, with vendors split inside
    each host (a,b on both) or across hosts (a,a on host 0, b,b on host 1); transports as the
    registry chose them from what each rank really sees."""
    out = str(tmp_path)
    vendors = ["a,b", "a,b"] if layout == "1+1 per host" else ["a,a", "b,b"]
    extra = {} if forced == "auto" else {"HETCCL_TRANSPORT": forced}
    procs = _launch(hosts2, "collectives", out, {"full": forced == "auto"}, vendors, **extra)
    codes = _finish(procs, 240, out)
    assert codes == [0, 0], _logs(out)
    res = _results(out, "collectives")
    assert sorted(res) == [0, 1, 2, 3], _logs(out)
    for r, d in res.items():
        # "skip: ..." marks a case for another device type (collective_cases)
        bad = {k: v for k, v in d["results"].items() if v != "ok" and not v.startswith("skip:")}
        assert not bad, f"rank {r}: {bad}"
        assert sum(v == "ok" for v in d["results"].values()) > 100, d["results"]
    # hosts: two ranks per hostname, one host identity per hostname, different across hosts
    by_host = {}
    for r, d in res.items():
        by_host.setdefault(d["hostname"], set()).add(d["host_id"])
    assert len(by_host) == 2 and all(len(v) == 1 for v in by_host.values()), by_host
    assert len({next(iter(v)) for v in by_host.values()}) == 2, by_host
    for r, d in res.items():
        for p, kind in d["kind_of"].items():
            same = res[int(p)]["hostname"] == d["hostname"]
            want = forced if forced != "auto" else ("shm" if same else "tcp")
            assert kind == want, f"rank {r} -> {p} ({'same' if same else 'other'} host): {kind}"
    if layout == "2+2 across":
        assert all(k == "tcp" for d in res.values() for k in d["kind_of"].values())


# ---------------------------------------------------------------------- faults
TIMEOUT_S = 6.0


def _wait_ready(out, n, procs, limit=120):
    end = time.monotonic() + limit
    while len(glob.glob(os.path.join(out, "ready-r*"))) < n:
        assert time.monotonic() < end, f"ranks not ready\n{_logs(out)}"
        assert all(p.poll() is None for p in procs), f"a launcher ended early\n{_logs(out)}"
        time.sleep(0.05)


def _check_survivors(res, ranks, t_fault, hosts, victims_host=None):
    """Every surviving rank: an error naming a peer rank and its host, within the timeout plus
    slack, later ops fail at once, nothing left behind. Returns {rank: seconds to the error}."""
    times = {}
    named_victim = []
    for r in ranks:
        d = res.get(r)
        assert d is not None, f"rank {r} wrote no result"
        assert d["ok_before"], f"rank {r}: wrong result before the fault"
        assert d["error"], f"rank {r}: no error after the fault ({d['ops']} ops)"
        m = re.findall(r"rank (\d+): host (\S+?),", d["error"])
        assert m, f"rank {r}: error does not name a peer's host: {d['error']}"
        if victims_host is not None:
            # The error names the lost host, or -- a cascade, when a peer on this rank's own
            # host failed first and closed its transport while this rank still waited on it, or
            # when this rank's timeout ran out on such a peer that itself still waited on the
            # lost host (SIGSTOP: nothing closes, every survivor times out, in whatever order)
            # -- that peer and its host (a known gap: the root cause is then one hop away).
            # Whoever saw the loss first must still name the lost host (below).
            cascade = ("closed its transport" in d["error"] or "Timed out" in d["error"]) and all(
                int(p) in ranks for p, _ in m)
            assert any(h == victims_host for _, h in m) or cascade, (r, d["error"])
            named_victim.append(any(h == victims_host for _, h in m))
        dt = d["t_err"] - t_fault
        assert dt <= TIMEOUT_S + 8, f"rank {r}: error after {dt:.1f} s: {d['error']}"
        times[r] = round(dt, 2)
        assert d["again"] and "second op succeeded" not in d["again"], d["again"]
        assert d["shm"] == [] and d["fds"] == [], (r, d["shm"], d["fds"])
        assert not [t for t in d["threads"] if t.startswith("hetccl")], (r, d["threads"])
        assert d["buffer_freed"], (f"rank {r}: the failed collective's buffer is still referenced "
                                   f"by {d['holders']}: {d['error']}")
    # whoever saw the loss first named the lost host (the others may name it one hop away)
    assert victims_host is None or any(named_victim), {r: res[r]["error"] for r in ranks}
    return times


FAULTS = {}


@pytest.mark.parametrize("fault", ["link_down", "sigkill_host", "sigstop_host"])
def test_fault(hosts2, tmp_path, fault):
    out = str(tmp_path)
    # vendors inside each host and across them: the fault cuts tcp pairs and shm survives
    procs = _launch(hosts2, "fault", out, {"timeout_s": TIMEOUT_S}, ["a,b", "a,b"])
    _wait_ready(out, 4, procs)
    time.sleep(0.3)  # inside one of the 64 MiB all_reduces
    t_fault = time.time()
    if fault == "link_down":
        hosts2.link(1, up=False)
    elif fault == "sigkill_host":
        hosts2.signal_host(1, signal.SIGKILL)
    else:
        hosts2.signal_host(1, signal.SIGSTOP)
    survivors = [0, 1] if fault == "link_down" else [0]
    # the workers' results, not the launchers' exit: torchrun's agents end with an exit barrier
    # through the rendezvous store, which a cut link or a dead host holds for its 300 s timeout
    res = _wait_results(out, "fault", 2 * len(survivors), TIMEOUT_S + 40)
    ranks = sorted(r for r, d in res.items() if d["hostname"] in
                   {hosts2.hostname(i) for i in survivors})
    assert len(ranks) == 2 * len(survivors), (sorted(res), _logs(out))
    victims = None if fault == "link_down" else hosts2.hostname(1)
    times = _check_survivors(res, ranks, t_fault, hosts2, victims)
    FAULTS[fault] = times
    print(f"\n{fault}: seconds to the error per rank {times}")


def test_host_never_joins(hosts2, tmp_path):
    """Host 1 never starts: host 0's torchrun ends within the rendezvous join timeout with an
    error that says the rendezvous did not complete (torch's wording), and hetccl never runs."""
    out = str(tmp_path)
    t0 = time.monotonic()
    procs = _launch(hosts2, "fault", out, {"timeout_s": TIMEOUT_S, "join_timeout": 5},
                    ["a,b", "a,b"], only=[0])
    codes = _finish(procs, 90, out)
    dt = time.monotonic() - t0
    log = _logs(out)
    assert codes[0] != 0 and dt < 60, (codes, dt, log)
    assert re.search(r"RendezvousTimeoutError|timed out|timeout", log, re.I), log
    assert not _results(out, "fault")
    print(f"\nnever joins: launcher ended after {dt:.1f} s")


def test_netem_delay_and_loss(hosts2, tmp_path):
    ok, why = netns.netem_available()
    if not ok:
        pytest.skip(why)
    out = str(tmp_path)
    hosts2.netem(1, "delay 5ms loss 2%")
    procs = _launch(hosts2, "collectives", out, {"full": False}, ["a,b", "a,b"])
    codes = _finish(procs, 240, out)
    assert codes == [0, 0], _logs(out)
    for r, d in _results(out, "collectives").items():
        assert all(v == "ok" or v.startswith("skip:") for v in d["results"].values()), r


# ---------------------------------------------------------------------- elastic restart
def test_elastic_restart_resumes_exactly(hosts2, tmp_path):
    """A rank of host 1 is SIGKILLed at step 5 of the first attempt; torchrun (--max-restarts 1)
    re-forms the group on both hosts, training resumes from the checkpoint and ends with exactly
    the parameters of a run without failure."""
    out = str(tmp_path)
    args = {"steps": 10, "kill_at": 5, "victim": 3, "timeout_s": TIMEOUT_S, "numel": 4096}
    procs = _launch(hosts2, "train", out, args, ["a,b", "a,b"], max_restarts=1)
    codes = _finish(procs, 180, out)
    assert codes == [0, 0], _logs(out)
    res = _results(out, "train")  # only the attempt that finished writes results
    assert sorted(res) == [0, 1, 2, 3], (sorted(res), _logs(out))
    assert os.path.exists(os.path.join(out, "killed"))
    assert max(d["restart"] for d in res.values()) == 1, [d["restart"] for d in res.values()]
    w = torch.zeros(args["numel"], dtype=torch.float64)
    for step in range(args["steps"]):
        grad = sum(torch.randint(-8, 9, w.shape, generator=torch.Generator().manual_seed(
            1000 * step + r)).to(torch.float64) for r in range(4))
        w -= 0.25 * grad / 4
    for r in range(4):
        assert 0 < res[r]["resumed_at"] <= args["kill_at"], res[r]["resumed_at"]
        got = torch.load(os.path.join(out, f"w-r{r}.pt"))
        assert torch.equal(got, w), f"rank {r}: max diff {(got - w).abs().max()}"


# ---------------------------------------------------------------------- security
PROBE = r"""
import json, os, socket, sys
targets = json.loads(sys.argv[1])
out = []
for addr, port in targets:
    for _ in range(3):
        got = b""
        try:
            s = socket.create_connection((addr, port), timeout=2)
            s.settimeout(0.5)
            try:
                got += s.recv(4096)
            except OSError:
                pass
            try:
                s.sendall(os.urandom(4096))
                while True:
                    b = s.recv(4096)
                    if not b:
                        break
                    got += b
            except OSError:
                pass
            s.close()
            out.append({"addr": addr, "port": port, "connected": True, "got": len(got),
                        "head": got[:8].hex()})
        except OSError as e:
            out.append({"addr": addr, "port": port, "connected": False, "error": str(e)})
print(json.dumps(out))
"""


@pytest.mark.parametrize("forced", ["tcp", pytest.param("ucx", marks=pytest.mark.slow)])
def test_third_namespace_gets_nothing(tmp_path, forced):
    """A machine on the fabric that is not in the job connects to every listening socket of
    every rank (the bridge's listeners: tcp's acceptor, UCX's sockets), reads, sends garbage:
    it gets at most tcp's 32-byte challenge (magic + nonce, no secret, no data), and the job's
    verified all_reduces run on with 0 wrong and no error."""
    with netns.Hosts(2, extra=1) as h:
        out = str(tmp_path)
        procs = _launch(h, "steady", out, {"seconds": 90, "timeout_s": 30}, ["a,b", "a,b"],
                        HETCCL_TRANSPORT=forced)
        _wait_ready(out, 4, procs)
        workers = set()
        targets = []
        for i in range(2):
            for port, pid in h.listeners(i):
                # the launcher's own stores (torchrun's rendezvous, the agent store) are torch's,
                # not the bridge's: only sockets of worker processes are probed
                if _is_worker(pid):
                    targets.append((h.addr(i), port))
                    workers.add(pid)
        assert targets, "no bridge listener found"
        r = h.run(0, [sys.executable, "-c", PROBE, json.dumps(targets)], extra_machine=True,
                  timeout=120)
        assert r.returncode == 0, r.stderr
        probes = json.loads(r.stdout)
        assert all(p.poll() is None for p in procs), "the job ended before the probes did"
        open(os.path.join(out, "stop"), "w").close()
        codes = _finish(procs, 90, out)
        assert codes == [0, 0], _logs(out)
        res = _results(out, "steady")
        assert sorted(res) == [0, 1, 2, 3]
        assert all(d["wrong"] == 0 and d["ops"] > 0 for d in res.values()), res
        assert any(p["connected"] for p in probes), probes
        for p in probes:
            # tcp's acceptor sends its challenge (kA1 = 32 bytes: "HETCTCP1", version, rank,
            # nonce) and drops the connection on a wrong proof; nothing else answers
            assert p.get("got", 0) <= 32, p
            if p.get("got"):
                assert bytes.fromhex(p["head"]).startswith(b"HETCTCP1"), p
        print("\n" + "\n".join(json.dumps(p) for p in probes))
        print(f"\n{forced}: {len(targets)} listeners probed, "
              f"{sum(p['connected'] for p in probes)} connections, "
              f"max {max(p.get('got', 0) for p in probes)} bytes received")


def _is_worker(pid: int) -> bool:
    """pid runs netns_worker.py itself (not the torchrun agent, whose argv names it later)."""
    try:
        cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    except OSError:
        return False
    return (any(c.endswith(b"netns_worker.py") for c in cmd)
            and b"torch.distributed.run" not in cmd)


# ---------------------------------------------------------------------- soak
@pytest.mark.slow
def test_soak_across_hosts(capsys):
    """`hetccl bench soak --netns 2` (2 hosts x 2 ranks, vendors a,b on each host; short here,
    the documented run is minutes): 0 wrong, 0 leaks (segments left in each host's /dev/shm,
    threads, fds)."""
    from hetccl.bench import soak

    rc = soak.main(["--netns", "2", "--seconds", "8", "--max-elems", "100000", "--no-progress"])
    out = capsys.readouterr().out
    assert "wrong results     : 0" in out, out
    assert "leaks             : 0" in out, out
    assert "on each of 2 hosts" in out and rc == 0, out
    ops = int(re.search(r"operations +: (\d+)", out).group(1))
    assert ops > 10, out


def test_capi_between_hosts(hosts2, tmp_path):
    """The C API (csrc/hetccl.h) between two real hosts, two ranks each, torch-free ranks: its
    own bootstrap (the root runs in rank 0 on host 0; the id names host 0's address), shm
    between the ring neighbours of a host, tcp between hosts; every case of
    tests/capi_worker.py against its references, the same bits on every rank."""
    here = os.path.dirname(os.path.abspath(__file__))
    uidf = str(tmp_path / "uid")
    outs = [str(tmp_path / f"capi-r{r}.json") for r in range(4)]
    for r in range(4):
        with open(str(tmp_path / f"capi-r{r}.cfg"), "w") as f:
            json.dump({"uid": "file:" + uidf, "rank": r, "n": 4, "mode": "cases",
                       "out": outs[r]}, f)
    procs = []
    for host in range(2):  # one launch per host: its ranks share the host's /dev/shm
        ranks = (2 * host, 2 * host + 1)
        a, b = (f'"$0" {os.path.join(here, "capi_worker.py")} {tmp_path / f"capi-r{r}.cfg"} '
                f'> {tmp_path / f"capi-r{r}.log"} 2>&1' for r in ranks)
        script = f"{a} & pa=$!; {b} & pb=$!; wait $pa; ra=$?; wait $pb; rb=$?; exit $((ra | rb))"
        procs.append(hosts2.popen(host, ["sh", "-c", script, sys.executable],
                                  env=dict(os.environ, HETCCL_TIMEOUT_S="60")))
    codes = netns.wait_all(procs, 240)
    logs = "\n".join(open(str(tmp_path / f"capi-r{r}.log")).read()[-2000:] for r in range(4))
    assert codes == [0, 0], (codes, logs)
    res = {r: json.load(open(o)) for r, o in enumerate(outs)}
    bad = {f"rank {r}: {k}": v for r in res for k, v in res[r]["cases"].items() if v != "ok"}
    assert not bad, "\n".join(f"{k}: {v}" for k, v in list(bad.items())[:20])
    for key in res[0]["digests"]:
        assert len({res[r]["digests"].get(key) for r in res}) == 1, key
    for r, d in res.items():  # neighbours 0-1 and 2-3 share a host; 1-2 and 3-0 cross hosts
        assert d["info"]["links_shm"] == "1", (r, d["info"])
