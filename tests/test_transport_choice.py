"""Transport choice as data (hetccl/transports.py over _C.transport_table()), the HETCCL_TRANSPORT
override, and the UCX restrictions between emulated vendors (no cuda_ipc / device paths, no
shared memory between emulated hosts), read back from UCX itself.

Pure tables first (milliseconds), then UCX contexts in this process (no peer needed), then one
2+1 group on emulated hosts over UCX end to end."""
from __future__ import annotations

import itertools
import random

import pytest

from hetccl import config, transports
from hetccl._core import _C
from hetccl.launch import spawn

HAS_UCX = "ucx" in _C.transport_names()
needs_ucx = pytest.mark.skipif(not HAS_UCX, reason="hetccl._C built without the UCX transport")


def _t(pref, same=True, other=True, memory=("host",), direct_safe=()):
    return {"preference": pref, "same_host": same, "other_host": other, "memory": list(memory),
            "direct_safe": list(direct_safe)}


# What a CPU machine's build declares; a GPU box whose UCX handles CUDA memory with cuda_copy
# (the GPU box: its own threads would call the CUDA runtime); one whose transport declares a
# runtime-free CUDA path and has a peer-memory module (direct_safe: no UCX of this build does).
CPU = {"shm": _t(10, other=False), "tcp": _t(30), "ucx": _t(40)}
GPU = {"shm": _t(10, other=False), "tcp": _t(30), "ucx": _t(20, memory=("host", "cuda"))}
GPUDIRECT = {**GPU, "ucx": _t(20, memory=("host", "cuda"), direct_safe=("cuda",))}


# ------------------------------------------------------------------ the table of this build
def test_local_table_declares_every_transport_once_in_preference_order():
    table = transports.local_table()
    names = [t["name"] for t in table]
    assert sorted(names) == sorted(_C.transport_names()) and len(set(names)) == len(names)
    prefs = [t["preference"] for t in table]
    assert prefs == sorted(prefs)
    by = {t["name"]: t for t in table}
    assert by["shm"]["same_host"] and not by["shm"]["other_host"] and by["shm"]["zero_copy"]
    assert by["tcp"]["same_host"] and by["tcp"]["other_host"] and by["tcp"]["memory"] == ["host"]
    for t in table:
        assert "host" in t["memory"] and t["detail"], t
    if HAS_UCX:
        # UCX was asked (ucp_context_query): this CPU machine has no CUDA driver, so host only,
        # and without RDMA or device memory UCX ranks after hetccl's own tcp
        u = by["ucx"]
        assert u["other_host"] and u["detail"].startswith("UCX ")
        if "cuda" not in u["memory"] and "RDMA" not in u["detail"]:
            assert u["preference"] > by["tcp"]["preference"]


def test_direct_safe_needs_a_runtime_free_path_and_peer_memory():
    """publishable() marks a device memory type direct-safe only where the transport moves it
    without runtime calls off the issuing thread (runtime_free) and the NIC
    registers that vendor's memory through a peer-memory module (dma-buf goes through the
    runtime on the registering thread in UCX 1.22); direct_kinds() follows HETCCL_UCX_DEVICE."""
    row = {"name": "ucx", "preference": 20, "same_host": True, "other_host": True,
           "memory": ["host", "cuda", "rocm"], "rdma": True, "runtime_free": ["cuda", "rocm"],
           "detail": "x"}
    assert transports.publishable([row], peer_kinds=set())["ucx"]["direct_safe"] == []
    assert transports.publishable([row], peer_kinds={"cuda"})["ucx"]["direct_safe"] == ["cuda"]
    assert transports.publishable([{**row, "runtime_free": []}], peer_kinds={"cuda", "rocm"})[
        "ucx"]["direct_safe"] == []
    assert transports.peer_memory_kinds({"nvidia_peermem", "ib_core"}) == {"cuda"}
    assert transports.peer_memory_kinds({"amdp2p"}) == {"rocm"}
    assert transports.peer_memory_kinds(set()) == set()
    e = transports.publishable([row], peer_kinds={"rocm"})["ucx"]
    assert transports.direct_kinds(e, "auto") == ["rocm"]
    assert transports.direct_kinds(e, "off") == []
    assert transports.direct_kinds(e, "force") == ["cuda", "rocm"]
    # this build: no transport claims a runtime-free device path (UCX's posts under RDMA carry
    # no prepared handle, so UCP would query memory through cuda_copy on the proxy: ucx_caps)
    for t in transports.local_table():
        assert t["runtime_free"] == [], t


def test_published_table_carries_what_the_choice_reads():
    """Other ranks see only publishable(): RDMA (which keeps UCX before tcp while the direct
    device path is off) must survive it, as the fields choose() reads."""
    local = transports.local_table()
    pub = transports.publishable(local)
    for t in local:
        assert pub[t["name"]]["rdma"] == t["rdma"] and isinstance(t["rdma"], bool), t
    ucx_rdma = {"name": "ucx", "preference": 20, "same_host": True, "other_host": True,
                "memory": ["host", "cuda"], "rdma": True, "detail": "x"}
    tcp = {"name": "tcp", "preference": 30, "same_host": True, "other_host": True,
           "memory": ["host"], "rdma": False, "detail": "y"}
    both = transports.publishable([ucx_rdma, tcp])
    assert transports.choose(0, 1, both, both, False, kind_a="cuda", kind_b="cuda",
                             device="off") == transports.Choice("ucx", False)
    no_rdma = transports.publishable([{**ucx_rdma, "rdma": False}, tcp])
    assert transports.choose(0, 1, no_rdma, no_rdma, False, kind_a="cuda", kind_b="cuda",
                             device="off") == transports.Choice("tcp", False)


# ------------------------------------------------------------------ choice per peer
def test_same_host_gets_shm_other_hosts_get_the_preferred_network_transport():
    assert transports.choose(0, 1, CPU, CPU, True) == transports.Choice("shm", False)
    assert transports.choose(0, 1, CPU, CPU, False) == transports.Choice("tcp", False)
    # a UCX that moves device memory without runtime calls on its threads is preferred between
    # hosts, device memory direct (HETCCL_UCX_DEVICE=auto, the default)
    assert transports.choose(0, 1, GPUDIRECT, GPUDIRECT, False, kind_a="cuda",
                             kind_b="cuda") == transports.Choice("ucx", True)
    # ... still shm on one host
    assert transports.choose(0, 1, GPUDIRECT, GPUDIRECT, True, kind_a="cuda",
                             kind_b="cuda").transport == "shm"
    # ... and not direct for a rank that shares its host with another vendor (its UCX context
    # loses GDRCopy: ucx_exclusions), nor with HETCCL_UCX_DEVICE=off: then it is a UCX whose only
    # edge is device memory, ranked after tcp
    for alone in ((False, True), (True, False)):
        assert transports.choose(0, 1, GPUDIRECT, GPUDIRECT, False, kind_a="cuda", kind_b="cuda",
                                 alone_a=alone[0], alone_b=alone[1]) == \
            transports.Choice("tcp", False)
    assert transports.choose(0, 1, GPUDIRECT, GPUDIRECT, False, kind_a="cuda", kind_b="cuda",
                             device="off") == transports.Choice("tcp", False)
    # a UCX whose device path calls the runtime from its threads (cuda_copy: the GPU box) is
    # not direct under auto, and ranks after tcp; force hands it device memory anyway
    assert transports.choose(0, 1, GPU, GPU, False, kind_a="cuda", kind_b="cuda") == \
        transports.Choice("tcp", False)
    assert transports.choose(0, 1, GPU, GPU, False, kind_a="cuda", kind_b="cuda",
                             device="force") == transports.Choice("ucx", True)
    assert transports.choose(0, 1, GPU, GPU, False, "ucx", kind_a="cuda", kind_b="cuda") == \
        transports.Choice("ucx", False)
    # one end safe, the other not: staged
    assert transports.choose(0, 1, GPUDIRECT, GPU, False, "ucx", kind_a="cuda",
                             kind_b="cuda") == transports.Choice("ucx", False)
    assert transports.choose(0, 1, GPU, GPU, False, kind_a="cuda", kind_b="cuda",
                             device="off") == transports.Choice("tcp", False)
    assert transports.choose(0, 1, GPU, GPU, False, "ucx", kind_a="cuda", kind_b="cuda",
                             device="off") == transports.Choice("ucx", False)
    # with RDMA it stays first
    rdma = {**GPU, "ucx": {**GPU["ucx"], "rdma": True}}
    assert transports.choose(0, 1, rdma, rdma, False, kind_a="cuda", kind_b="cuda",
                             device="off") == transports.Choice("ucx", False)
    # a CPU rank (host tensors) never takes the direct device path
    assert transports.choose(0, 1, GPU, GPU, False, kind_a="cpu", kind_b="cuda").device_direct \
        is False


def test_choice_uses_both_tables():
    # one end has no UCX: tcp, whatever the other prefers
    no_ucx = {k: v for k, v in GPU.items() if k != "ucx"}
    assert transports.choose(0, 1, GPU, no_ucx, False).transport == "tcp"
    # one end's UCX handles CUDA, the other's not: ucx is ranked by the worse of the two (40,
    # after tcp), and device memory cannot go direct
    assert transports.choose(0, 1, GPU, CPU, False, kind_a="cuda", kind_b="cuda") == \
        transports.Choice("tcp", False)
    gpu_only_ucx = {"ucx": GPU["ucx"]}
    assert transports.choose(0, 1, gpu_only_ucx, CPU, False, kind_a="cuda", kind_b="cuda") == \
        transports.Choice("ucx", False)


def test_choice_is_symmetric():
    rnd = random.Random(18)
    names = ["shm", "tcp", "ucx", "xyz"]
    for _ in range(300):
        tabs = []
        for _side in range(2):
            tabs.append({n: _t(rnd.randint(0, 50), rnd.random() < 0.7, rnd.random() < 0.7,
                               ("host", "cuda") if rnd.random() < 0.5 else ("host",))
                         for n in names if rnd.random() < 0.8})
        kinds = [rnd.choice(["cuda", "cpu"]) for _ in range(2)]
        for same in (True, False):
            try:
                ab = transports.choose(0, 1, tabs[0], tabs[1], same, kind_a=kinds[0], kind_b=kinds[1])
            except ValueError:
                ab = "error"
            try:
                ba = transports.choose(1, 0, tabs[1], tabs[0], same, kind_a=kinds[1], kind_b=kinds[0])
            except ValueError:
                ba = "error"
            assert ab == ba, (tabs, kinds, same)


def test_adding_a_transport_is_a_table_row():
    """A new transport needs no code in the chooser: a row that reaches other hosts with a
    better preference than tcp wins there, and loses on one host to shm."""
    rdma = {**CPU, "verbs": _t(15, same=False)}
    assert transports.choose(0, 1, rdma, rdma, False).transport == "verbs"
    assert transports.choose(0, 1, rdma, rdma, True).transport == "shm"


def test_capabilities_not_names_decide_links_and_rank():
    """What the bridge and the engine read off a choice comes from the capability tables, not
    from a transport's name: the zero-copy ring (ring link or message link), the transport that
    links same-vendor ranks of one host (bridge.group_links), and the rank of a transport whose
    edge is device memory while the direct device path is off."""
    pub = transports.publishable(transports.local_table())
    assert all(pub[n]["zero_copy"] == (n == "shm") for n in pub), pub
    assert transports.choose(0, 1, pub, pub, True) == transports.Choice("shm", False, True)
    assert transports.choose(0, 1, pub, pub, False).zero_copy is False
    assert transports.shared_ring([pub, pub]) == "shm"
    assert transports.shared_ring([pub, {k: v for k, v in pub.items() if k != "shm"}]) is None
    assert transports.shared_ring([]) is None
    # a second same-host ring transport, preferred: it links the group, and carries pairs on
    # one host as a ring link
    ring = {**pub, "xpmem": {**pub["shm"], "preference": 5}}
    assert transports.shared_ring([ring, ring]) == "xpmem"
    assert transports.choose(0, 1, ring, ring, True) == transports.Choice("xpmem", False, True)
    # a ring listed by one table only is no ring for the pair
    assert transports.choose(0, 1, ring, pub, True) == transports.Choice("shm", False, True)
    # any transport that takes device memory without RDMA ranks after tcp where device memory
    # does not go to it directly: device="off", or auto without a runtime-free device path
    dev = {**CPU, "gpunet": _t(20, memory=("host", "rocm"), direct_safe=("rocm",))}
    assert transports.choose(0, 1, dev, dev, False, kind_a="rocm", kind_b="rocm",
                             device="off") == transports.Choice("tcp", False)
    assert transports.choose(0, 1, dev, dev, False, kind_a="rocm", kind_b="rocm") == \
        transports.Choice("gpunet", True)
    unsafe = {**CPU, "gpunet": _t(20, memory=("host", "rocm"))}
    assert transports.choose(0, 1, unsafe, unsafe, False, kind_a="rocm", kind_b="rocm") == \
        transports.Choice("tcp", False)


# ------------------------------------------------------------------ the override
def test_override_forces_one_transport():
    assert transports.choose(0, 1, CPU, CPU, True, forced="tcp").transport == "tcp"
    assert transports.choose(0, 1, CPU, CPU, True, forced="ucx").transport == "ucx"
    assert transports.choose(0, 1, CPU, CPU, False, forced="ucx").transport == "ucx"


def test_override_errors_name_what_is_wrong():
    with pytest.raises(ValueError, match=r"HETCCL_TRANSPORT='carrier' is not available in rank 0's "
                                         r"build \(it has: shm, tcp, ucx\)"):
        transports.choose(0, 1, CPU, CPU, False, forced="carrier")
    no_ucx = {k: v for k, v in CPU.items() if k != "ucx"}
    with pytest.raises(ValueError, match=r"'ucx' is not available in rank 3's build \(it has: shm, tcp\)"):
        transports.choose(0, 3, CPU, no_ucx, False, forced="ucx")
    with pytest.raises(ValueError, match=r"HETCCL_TRANSPORT='shm' cannot reach rank 2 from rank 0: "
                                         r"they are on different hosts"):
        transports.choose(0, 2, CPU, CPU, False, forced="shm")
    with pytest.raises(ValueError, match="no bridge transport reaches rank 1 from rank 0"):
        transports.choose(0, 1, {"shm": CPU["shm"]}, {"shm": CPU["shm"]}, False)


def test_unavailable_forced_transport_fails_every_rank_with_the_same_error():
    """Through the torch face: the bridge validates every pair on every rank (no rank is left
    waiting in connect())."""
    res = spawn(_init_expect_error, 2, vendors="1+1", timeout=90,
                env={"HETCCL_TRANSPORT": "shm", "HETCCL_EMULATE_HOSTS": "1"})
    assert res[0] == res[1], res
    assert "HETCCL_TRANSPORT='shm' cannot reach rank 1 from rank 0" in res[0], res


def _init_expect_error(ctx):
    from datetime import timedelta

    import torch.distributed as dist

    import hetccl  # noqa: F401

    try:
        dist.init_process_group("hetccl", init_method=ctx.init_method(), rank=ctx.rank,
                                world_size=ctx.world_size, timeout=timedelta(seconds=30))
        import torch
        dist.all_reduce(torch.ones(1))  # multi-vendor groups build their engine lazily or here
        return "no error"
    except ValueError as e:
        return str(e)


def test_ucx_exclusions():
    assert transports.ucx_exclusions("h1", ["h2", "h3"], False) == []  # real hosts apart: nothing
    assert transports.ucx_exclusions("h1", ["h2", "h1"], False) == list(transports.UCX_DEVICE_PATHS)
    both = transports.ucx_exclusions("h1", ["h1"], True)
    assert "cuda_ipc" in both and "posix" in both and "cma" in both and "tcp" not in both


def test_transport_options_come_from_one_place(monkeypatch):
    """transports.options: every transport's options from the settings in force, UCX's only
    where UCX runs, its exclusions from its peers' hosts and the direct device path."""
    monkeypatch.setenv("HETCCL_TCP_NCONN", "3")
    monkeypatch.setenv("HETCCL_UCX_LANES", "2")
    monkeypatch.setenv("HETCCL_UCX_COPY_THREAD", "0")
    tcp = transports.options("tcp", secret="s", slot_bytes=4096, bind_addr="10.0.0.1")
    assert tcp["nconn"] == "3" and tcp["secret"] == "s" and tcp["bind_addr"] == "10.0.0.1"
    assert tcp["slot_bytes"] == "4096" and not any(k in tcp for k in ("lanes", "exclude_tls", "ucx_config"))
    apart = transports.options("ucx", secret="s", slot_bytes=4096, my_host="h1", peer_hosts=["h2"])
    assert apart["lanes"] == "2" and apart["copy_thread"] == "off"
    assert apart["exclude_tls"].split(",") == list(transports.UCX_COPY_PATHS)  # no device memory to UCX
    direct = transports.options("ucx", secret="s", slot_bytes=4096, my_host="h1", peer_hosts=["h2"],
                                any_direct=True)
    assert direct["exclude_tls"] == ""
    here = transports.options("ucx", secret="s", slot_bytes=4096, my_host="h1", peer_hosts=["h1"],
                              emulate_hosts=True)["exclude_tls"].split(",")
    assert set(transports.UCX_DEVICE_PATHS + transports.UCX_SHM_PATHS + transports.UCX_COPY_PATHS) == set(here)
    assert "bind_addr" not in apart
    assert set(transports.settings_in_force()) == {"HETCCL_UCX_TUNING (in force)"}


def test_ucx_lanes_auto_counts_cores_per_rank_and_is_one_with_rdma(monkeypatch):
    """HETCCL_UCX_LANES=auto (the default): the job's smallest cores / (2 x ranks on the host),
    1..8, from lists every rank has; 1 where any rank's UCX has RDMA; a count is taken as is.
    A bad value is refused naming the variable."""
    lanes = transports.ucx_lanes
    assert lanes("auto", [2, 2], ["h", "h"], False) == 1          # the 2-core CI machine
    assert lanes("auto", [16, 16], ["h", "h"], False) == 4        # the 16-core GPU box, 1+1
    assert lanes("auto", [16, 16, 64], ["a", "a", "b"], False) == 4  # the busiest host decides
    assert lanes("auto", [128, 128], ["a", "b"], False) == 8      # clamped
    assert lanes("auto", [16, 16], ["a", "b"], True) == 1         # RDMA: UCX stripes itself
    assert lanes("auto", [1], ["a"], False) == 1
    assert lanes(3, [2, 2], ["h", "h"], True) == 3
    # the same count on every rank whatever the rank order
    cores, hosts = [8, 32, 32, 12], ["a", "b", "b", "a"]
    assert lanes("auto", cores, hosts, False) == lanes("auto", cores[::-1], hosts[::-1], False) == 2
    monkeypatch.setenv("HETCCL_UCX_LANES", "auto")
    assert config.get("HETCCL_UCX_LANES") == "auto"
    caps = [{"cores": 16, "table": {"ucx": {"rdma": False}}}, {"cores": 16, "table": {}}]
    assert transports.job_ucx_lanes(caps, ["h", "h"]) == 4
    caps[1]["table"] = {"ucx": {"rdma": True}}
    assert transports.job_ucx_lanes(caps, ["h", "g"]) == 1
    monkeypatch.setenv("HETCCL_UCX_LANES", "17")
    with pytest.raises(ValueError, match="HETCCL_UCX_LANES"):
        config.get("HETCCL_UCX_LANES")
    monkeypatch.setenv("HETCCL_UCX_LANES", "many")
    with pytest.raises(ValueError, match="HETCCL_UCX_LANES"):
        config.get("HETCCL_UCX_LANES")
    monkeypatch.setenv("HETCCL_UCX_LANES", "2")
    monkeypatch.setenv("HETCCL_UCX_LANE_THREADS", "0")
    o = transports.options("ucx", secret="s", slot_bytes=4096, my_host="h1", peer_hosts=["h2"])
    assert o["lanes"] == "2" and o["lane_threads"] == "off"
    monkeypatch.delenv("HETCCL_UCX_LANE_THREADS")
    o = transports.options("ucx", secret="s", slot_bytes=4096, my_host="h1", peer_hosts=["h2"],
                           ucx_lanes_in_force=5)
    assert o["lanes"] == "5" and o["lane_threads"] == "on"
    assert o["stripe_bytes"] == "0"  # striping off unless asked for
    assert o["spin_us"] == "50"
    monkeypatch.setenv("HETCCL_UCX_SPIN_US", "-3")
    with pytest.raises(ValueError, match="HETCCL_UCX_SPIN_US"):
        config.get("HETCCL_UCX_SPIN_US")
    monkeypatch.delenv("HETCCL_UCX_SPIN_US")
    monkeypatch.setenv("HETCCL_UCX_STRIPE_BYTES", "512K")
    o = transports.options("ucx", secret="s", slot_bytes=4096, my_host="h1", peer_hosts=["h2"])
    assert o["stripe_bytes"] == str(512 << 10)
    monkeypatch.setenv("HETCCL_UCX_STRIPE_BYTES", "-1")
    with pytest.raises(ValueError, match="HETCCL_UCX_STRIPE_BYTES"):
        config.get("HETCCL_UCX_STRIPE_BYTES")


def test_ucx_tuning_leaves_user_settings_alone(monkeypatch):
    monkeypatch.setenv("HETCCL_UCX_TUNING", "TCP_TX_SEG_SIZE=256K; UCX_TCP_RX_SEG_SIZE=1M")
    monkeypatch.delenv("UCX_TCP_TX_SEG_SIZE", raising=False)
    monkeypatch.delenv("UCX_TCP_RX_SEG_SIZE", raising=False)
    assert config.ucx_tuning() == "TCP_TX_SEG_SIZE=256K;TCP_RX_SEG_SIZE=1M"
    monkeypatch.setenv("UCX_TCP_RX_SEG_SIZE", "64K")  # the user's value wins
    assert config.ucx_tuning() == "TCP_TX_SEG_SIZE=256K"
    monkeypatch.setenv("HETCCL_UCX_TUNING", "none")
    assert config.ucx_tuning() == ""
    monkeypatch.setenv("HETCCL_UCX_TUNING", "TCP_TX_SEG_SIZE")
    with pytest.raises(ValueError, match="HETCCL_UCX_TUNING entry 'TCP_TX_SEG_SIZE' is not KEY=VALUE"):
        config.ucx_tuning()


def test_ucx_max_message_follows_the_send_segment_in_force(monkeypatch):
    """auto: 2 x the tcp send segment in force less a page (UCX 1.22's largest zero-copy
    message over tcp, page-rounded), where that segment is 256 KiB or more; the environment's
    UCX_TCP_TX_SEG_SIZE before the tuning's; a number is taken as given, 0 is no bound."""
    for k in ("HETCCL_UCX_MAX_MESSAGE", "HETCCL_UCX_TUNING", "UCX_TCP_TX_SEG_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert transports.ucx_max_message() == (2 << 20) - 4096  # the default tuning's 1M segment
    o = transports.options("ucx", secret="s", slot_bytes=4096, my_host="h1", peer_hosts=["h2"])
    assert o["max_message"] == str((2 << 20) - 4096)
    monkeypatch.setenv("HETCCL_UCX_TUNING", "TCP_TX_SEG_SIZE=512K;TCP_RX_SEG_SIZE=4M")
    assert transports.ucx_max_message() == (1 << 20) - 4096
    monkeypatch.setenv("UCX_TCP_TX_SEG_SIZE", "3m")  # the user's segment wins
    assert transports.ucx_max_message() == (6 << 20) - 4096
    for small in ("128k", "8k", "inf", "auto"):  # too small to bound, or not a size: no bound
        monkeypatch.setenv("UCX_TCP_TX_SEG_SIZE", small)
        assert transports.ucx_max_message() == 0, small
    monkeypatch.delenv("UCX_TCP_TX_SEG_SIZE")
    monkeypatch.setenv("HETCCL_UCX_TUNING", "none")  # UCX's own 8 KiB segment: no bound
    assert transports.ucx_max_message() == 0
    monkeypatch.setenv("HETCCL_UCX_MAX_MESSAGE", "1M")
    assert transports.ucx_max_message() == 1 << 20
    monkeypatch.setenv("HETCCL_UCX_MAX_MESSAGE", "0")
    assert transports.ucx_max_message() == 0
    monkeypatch.setenv("HETCCL_UCX_MAX_MESSAGE", "-4K")
    with pytest.raises(ValueError, match="HETCCL_UCX_MAX_MESSAGE"):
        config.get("HETCCL_UCX_MAX_MESSAGE")


# ------------------------------------------------------------------ UCX restrictions, read back
DEVICE = ",".join(transports.UCX_DEVICE_PATHS)
HOSTS = ",".join(transports.UCX_DEVICE_PATHS + transports.UCX_SHM_PATHS)


def _ucx_info(monkeypatch, user_tls, exclude, **opts):
    if user_tls is None:
        monkeypatch.delenv("UCX_TLS", raising=False)
    else:
        monkeypatch.setenv("UCX_TLS", user_tls)  # UCX reads it when the context is created
    t = _C.Transport("ucx", 0, 1, {"exclude_tls": exclude, **opts})
    try:
        return dict(t.info())
    finally:
        t.close()


@needs_ucx
@pytest.mark.parametrize("user_tls, exclude, expect", [
    (None, DEVICE, "^" + DEVICE),                      # unset: everything but the device paths
    ("all", DEVICE, "^" + DEVICE),
    ("^sm", DEVICE, "^sm," + DEVICE),                 # a deny list grows
    ("tcp,cuda_ipc,self", DEVICE, "tcp,self"),        # an allow list shrinks, nothing else
    ("tcp,sm,self", HOSTS, "tcp,self"),               # aliases lose the members removed
    ("tcp,mm,cma,self", DEVICE, "tcp,mm,cma,self"),   # untouched when nothing is removed
    ("tcp,self", "", "tcp,self"),                     # no exclusion: the user's value as it is
])
def test_ucx_tls_in_force_excludes_device_paths(monkeypatch, user_tls, exclude, expect):
    info = _ucx_info(monkeypatch, user_tls, exclude)
    assert info["tls"] == expect, info
    for tl in info["resources"].split(","):  # what the context really has
        assert tl not in transports.UCX_DEVICE_PATHS or not exclude, info
        if exclude == HOSTS:
            assert tl not in transports.UCX_SHM_PATHS, info


@needs_ucx
def test_ucx_tls_that_leaves_nothing_is_a_clear_error(monkeypatch):
    with pytest.raises(_C.CommError, match=r"UCX_TLS=posix,sysv,self leaves no transport to reach "
                                           r"a peer once .*cuda_ipc.* are removed"):
        _ucx_info(monkeypatch, "posix,sysv,self", HOSTS)


@needs_ucx
def test_ucx_tuning_is_applied_and_bad_keys_are_named(monkeypatch):
    info = _ucx_info(monkeypatch, None, "", ucx_config="TCP_TX_SEG_SIZE=256K;TCP_RX_SEG_SIZE=1M",
                     lanes="3")
    assert info["tuning"] == "TCP_TX_SEG_SIZE=256K;TCP_RX_SEG_SIZE=1M" and info["lanes"] == "3"
    with pytest.raises(_C.CommError, match="UCX rejected the setting NO_SUCH_KNOB=1"):
        _ucx_info(monkeypatch, None, "", ucx_config="NO_SUCH_KNOB=1")
    with pytest.raises(_C.CommError, match="lanes"):
        _ucx_info(monkeypatch, None, "", lanes="0")


# ------------------------------------------------------------------ end to end, emulated hosts
@needs_ucx
@pytest.mark.parametrize("lanes", ["auto", "3"])
def test_emulated_hosts_over_ucx_2p1(lanes):
    """2+1 on one machine with HETCCL_EMULATE_HOSTS=1: auto picks tcp (UCX without RDMA or device
    memory ranks after it); forced ucx gets every collective right, and the UCX context the
    bridge created has neither device IPC nor shared memory (read back from UCX). Lanes: auto
    (one count for the job from every rank's cores) and three lanes with threads of their own."""
    import gpu_ucx_cases

    env = {"HETCCL_EMULATE_HOSTS": "1", "HETCCL_TRANSPORT": "ucx", "HETCCL_LOG_LEVEL": "INFO",
           "HETCCL_UCX_LANES": lanes}
    res = spawn(gpu_ucx_cases.run, 3, args=("cpu",), vendors="2+1", env=env, timeout=240)
    want = transports.ucx_lanes("auto", [transports.usable_cores()] * 3, ["h"] * 3, False) \
        if lanes == "auto" else int(lanes)
    for r, out in enumerate(res):
        assert out["ucx"]["lanes"] == str(want), out["ucx"]
        assert out["ucx"].get("lane_threads", "off") == ("on" if want > 1 else "off"), out["ucx"]
        bad = [k for k, v in out["correct"].items() if not v]
        assert not bad, f"rank {r}: wrong {bad}"
        assert set(out["choices"].values()) == {"ucx"}, out["choices"]
        tls, resources = out["ucx"]["tls"], out["ucx"]["resources"].split(",")
        assert tls.startswith("^") and "cuda_ipc" in tls and "posix" in tls, tls
        assert "cuda_copy" in tls and "rocm_copy" in tls, tls  # no device memory goes to UCX
        assert not set(resources) & set(transports.UCX_DEVICE_PATHS + transports.UCX_SHM_PATHS)
        assert "tcp" in resources, resources
        assert out["stats"].get("msg_host_bytes", 0) > 0, out["stats"]


def test_the_log_line_names_ucx_lanes_and_striping():
    """transports.describe: what the bridge's log line says about UCX's setup."""
    assert transports.describe({"tcp": {}}) == ""
    base = {"version": "1.22.0", "tls": "tcp,self", "lanes": "4"}
    assert transports.describe({"ucx": base}) == " [UCX 1.22.0: UCX_TLS=tcp,self, lanes 4]"
    threads = {**base, "lane_threads": "on", "stripe_bytes": "0"}
    assert transports.describe({"ucx": threads}).endswith("lanes 4 with threads]")
    striped = {**threads, "stripe_bytes": "524288"}
    assert "striped in parts of >= 524288 bytes" in transports.describe({"ucx": striped})
