"""Several hosts on one machine: each emulated host is a Linux network namespace with its own
address, its own /dev/shm (a tmpfs in a mount namespace of its own) and its own hostname (UTS
namespace), joined to the others by a bridge in a namespace of its own -- a small cluster with
real separate network stacks, for tests (tests/test_netns.py), `hetccl bench soak --netns` and
`hetccl bench collectives --netns`.

Layout of a `Hosts(n)` (every name carries this process's pid and a random part, so parallel
runs never collide and stale ones can be told from live ones):

    namespace <p>-f   : bridge "br0", one port "h<i>" per host (the fabric, no address)
    namespace <p>-h<i>: "eth0" = 10.213.0.<i+1>/24, the other end of port h<i>; lo up
    namespace <p>-x<j>: an extra machine on the same fabric (10.213.0.<100+j>), not a host of
                        the job: the "third namespace" of the security test
    /etc/netns/<p>-h<i>/hosts: every host's name -> address (`ip netns exec` binds it over
                        /etc/hosts, so hostnames resolve as on a cluster)

Commands run on host i through `ip netns exec <ns> unshare --mount --uts --propagation private`,
which mounts a fresh tmpfs on /dev/shm and sets the hostname before exec'ing the command: every
process started by one `popen(i, ...)` (a torchrun agent and its workers) shares that host's
/dev/shm; two popen calls on one host get two /dev/shm's, so a host's ranks must come from one
launcher, as on a cluster. Traffic stays on the 10.213.0.0/24 addresses inside these namespaces;
the machine's own interfaces are never touched.

Clean-up: close() kills what popen started (their process groups), deletes the namespaces and
the /etc/netns entries; it runs from a finalizer too. cleanup_stale() removes what a run whose
process is gone left behind (a killed pytest).

Requirements: root (or CAP_SYS_ADMIN + CAP_NET_ADMIN), `ip` (iproute2) and `unshare`
(util-linux). available() says whether they are there, with the reason when not.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import time
import weakref

SUBNET = "10.213.0"
_NAME = re.compile(r"^hc(\d+)x[0-9a-f]{4}-(f|h\d+|x\d+)$")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def available() -> tuple[bool, str]:
    """(True, "") when namespaces can be created here, else (False, the reason)."""
    for tool in ("ip", "unshare", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` is not installed"
    name = f"hc{os.getpid()}x{secrets.token_hex(2)}-f"
    r = _ip("netns", "add", name, check=False)
    if r.returncode != 0:
        return False, f"`ip netns add` failed (needs root / CAP_NET_ADMIN): {r.stderr.strip()}"
    try:
        r = subprocess.run(["ip", "netns", "exec", name, "unshare", "--mount", "--uts",
                            "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs tmpfs /dev/shm && hostname probe"],
                           capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            return False, f"mount/UTS namespaces unavailable: {r.stderr.strip()}"
    finally:
        _ip("netns", "del", name, check=False)
    return True, ""


def netem_available() -> tuple[bool, str]:
    """Whether the kernel has the netem qdisc (delay / loss), probed on a dummy namespace."""
    name = f"hc{os.getpid()}x{secrets.token_hex(2)}-f"
    _ip("netns", "add", name)
    try:
        _ip("-n", name, "link", "set", "lo", "up")
        r = subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo",
                            "root", "netem", "delay", "1ms"], capture_output=True, text=True)
        if r.returncode != 0:
            return False, f"the kernel has no netem qdisc (tc: {r.stderr.strip()})"
        return True, ""
    finally:
        _ip("netns", "del", name, check=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def cleanup_stale() -> list[str]:
    """Deletes the namespaces (and /etc/netns entries) of runs whose process is gone; returns
    their names."""
    gone = []
    r = _ip("netns", "list", check=False)
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NAME.match(name)
        if m and not _alive(int(m.group(1))):
            _ip("netns", "del", name, check=False)
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
            gone.append(name)
    if os.path.isdir("/etc/netns"):
        for name in os.listdir("/etc/netns"):
            m = _NAME.match(name)
            if m and not _alive(int(m.group(1))):
                shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
    return gone


def _ns_pids(name: str) -> list[int]:
    try:
        want = os.stat(f"/run/netns/{name}").st_ino
    except OSError:
        return []
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.stat(f"/proc/{d}/ns/net").st_ino == want:
                    out.append(int(d))
            except OSError:
                pass
    return out


def _teardown(names: list[str], procs: list) -> None:
    for n in names:  # every process left in the namespaces (workers run in sessions of their own)
        for pid in _ns_pids(n):
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
    for p in procs:
        _kill_tree(p)
    for n in names:
        _ip("netns", "del", n, check=False)
        shutil.rmtree(f"/etc/netns/{n}", ignore_errors=True)


def _kill_tree(p: subprocess.Popen) -> None:
    if p.poll() is not None:
        return
    try:
        os.killpg(p.pid, signal.SIGCONT)  # a stopped group dies only once continued
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


class Hosts:
    """n emulated hosts (and `extra` machines outside the job) on one fabric; see the module
    docstring. Use as a context manager, or call close()."""

    def __init__(self, n: int, extra: int = 0):
        if not 1 <= n <= 90 or not 0 <= extra <= 9:
            raise ValueError(f"hetccl netns: 1..90 hosts and 0..9 extra machines, got {n}, {extra}")
        cleanup_stale()
        self.n, self.extra = n, extra
        self.prefix = f"hc{os.getpid()}x{secrets.token_hex(2)}"
        self.fabric = f"{self.prefix}-f"
        self.names = [f"{self.prefix}-h{i}" for i in range(n)]
        self.extras = [f"{self.prefix}-x{j}" for j in range(extra)]
        self.procs: list[subprocess.Popen] = []
        self._all = [self.fabric] + self.names + self.extras
        self._finalizer = weakref.finalize(self, _teardown, self._all, self.procs)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ layout
    def addr(self, i: int) -> str:
        """Address of host i (extra machine j: addr(100 + j))."""
        return f"{SUBNET}.{i + 1}"

    def hostname(self, i: int) -> str:
        return f"{self.prefix}-h{i}"

    def _build(self) -> None:
        _ip("netns", "add", self.fabric)
        _ip("-n", self.fabric, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.fabric, "link", "set", "br0", "up")
        hosts_file = "".join(f"{self.addr(i)} {self.hostname(i)}\n" for i in range(self.n))
        hosts_file = "127.0.0.1 localhost\n" + hosts_file
        machines = [(ns, f"h{i}", self.addr(i)) for i, ns in enumerate(self.names)]
        machines += [(ns, f"x{j}", f"{SUBNET}.{101 + j}") for j, ns in enumerate(self.extras)]
        for ns, port, addr in machines:
            _ip("netns", "add", ns)
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port,
                "netns", self.fabric)
            _ip("-n", self.fabric, "link", "set", port, "master", "br0")
            _ip("-n", self.fabric, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                f.write(hosts_file)
        # the bridge forwards as soon as the ports are up (no STP delay: stp is off by default)

    # ------------------------------------------------------------------ running
    def argv(self, i: int, cmd: list[str], ns: str | None = None) -> list[str]:
        """The command line that runs `cmd` on host i: its network namespace, a fresh /dev/shm
        and its hostname."""
        ns = ns or self.names[i]
        host = self.hostname(i) if ns in self.names else ns
        script = ('mount -t tmpfs -o size=2g,mode=1777 hetccl-shm /dev/shm && hostname "$0" '
                  '&& exec "$@"')
        return ["ip", "netns", "exec", ns, "unshare", "--mount", "--uts", "--propagation",
                "private", "sh", "-c", script, host, *cmd]

    def popen(self, i: int, cmd: list[str], *, extra_machine: bool = False, env=None,
              **kw) -> subprocess.Popen:
        """Starts cmd on host i (or on extra machine i with extra_machine=True) in a process
        group of its own (so faults can signal a whole host: signal_host)."""
        ns = self.extras[i] if extra_machine else None
        p = subprocess.Popen(self.argv(i, cmd, ns), env=env, start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def run(self, i: int, cmd: list[str], *, extra_machine: bool = False, timeout: float = 60,
            **kw) -> subprocess.CompletedProcess:
        ns = self.extras[i] if extra_machine else None
        return subprocess.run(self.argv(i, cmd, ns), capture_output=True, text=True,
                              timeout=timeout, **kw)

    def torchrun(self, i: int, script: list[str], *, nproc: int, port: int,
                 max_restarts: int = 0, join_timeout: float = 60, env=None,
                 **kw) -> subprocess.Popen:
        """torchrun on host i exactly as on a cluster: --nnodes n --node-rank i, c10d rendezvous
        on host 0's address (host 0's agent hosts the rendezvous store: is_host is given
        explicitly, torch's own guess resolves hostnames). As on a cluster with a c10d
        rendezvous, torch ignores --node-rank and hands out global ranks in joining order:
        callers that need a layout label ranks by host and LOCAL_RANK, not by RANK."""
        import sys

        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(self.n),
               "--node-rank", str(i), "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"{self.addr(0)}:{port}",
               "--rdzv-conf", f"is_host={1 if i == 0 else 0},join_timeout={join_timeout}",
               "--max-restarts", str(max_restarts), "--monitor-interval", "0.2",
               "--local-addr", self.addr(i), *script]
        return self.popen(i, cmd, env=env, **kw)

    def pids(self, i: int) -> list[int]:
        """Every process in host i's network namespace (torchrun starts its workers in sessions
        of their own, so a process group does not cover a host)."""
        return _ns_pids(self.names[i])

    def signal_host(self, i: int, sig: int) -> None:
        """Sends sig to every process of host i (its launcher, its workers, their children)."""
        for pid in self.pids(i):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    # ------------------------------------------------------------------ faults
    def link(self, i: int, up: bool) -> None:
        """Sets host i's link to the fabric up or down (its eth0: carrier lost, no RST)."""
        _ip("-n", self.names[i], "link", "set", "eth0", "up" if up else "down")

    def netem(self, i: int, spec: str) -> None:
        """tc netem on host i's eth0 (e.g. "delay 20ms loss 5%"); RuntimeError naming the
        reason where the kernel has no netem."""
        r = subprocess.run(["ip", "netns", "exec", self.names[i], "tc", "qdisc", "replace",
                            "dev", "eth0", "root", "netem", *spec.split()],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"tc netem on host {i} failed: {r.stderr.strip()}")

    def listeners(self, i: int) -> list[tuple[int, int]]:
        """(port, pid) of every listening TCP socket in host i's namespace."""
        r = subprocess.run(["ip", "netns", "exec", self.names[i], "ss", "-ltnpH"],
                           capture_output=True, text=True, check=True)
        out = []
        for line in r.stdout.splitlines():
            cols = line.split()
            if len(cols) < 4:
                continue
            port = int(cols[3].rsplit(":", 1)[1])
            for pid in re.findall(r"pid=(\d+)", line):
                out.append((port, int(pid)))
        return sorted(set(out))

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> "Hosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    """Return codes of procs once all have ended or `timeout` seconds passed (None: running)."""
    end = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    return [p.poll() for p in procs]
