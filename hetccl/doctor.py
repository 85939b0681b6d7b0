"""`hetccl doctor`: what this rank sees, and (with --launch SPLIT) what a local group does.

Prints the vendor label and where it came from, the torch build and devices, the native
backend per device type, the bridge transports compiled in and the one each kind of peer
would get, and every HETCCL_* setting in force. `--launch 2+2` starts a local emulated group,
and every rank reports its vendor group and the transport it uses to each cross-vendor peer.
"""
from __future__ import annotations

import os

import argparse
import sys
from datetime import timedelta

import torch


def local_report() -> list[str]:
    from . import config, vendor
    from ._core import transport_names

    lines = []
    try:
        label = vendor.detect_vendor()
    except ValueError as e:  # HETCCL_VENDOR_SPLIT without RANK: the label depends on the rank
        label = f"(depends on the rank: {e})"
    src = ("HETCCL_VENDOR" if config.get("HETCCL_VENDOR") else
           "HETCCL_VENDOR_SPLIT" if config.get("HETCCL_VENDOR_SPLIT") else "detected")
    kind = vendor.build_kind()
    lines.append(f"vendor label      : {label} ({src}; torch build drives: {kind})")
    lines.append(f"torch             : {torch.__version__} (cuda {torch.version.cuda}, "
                 f"hip {getattr(torch.version, 'hip', None)})")
    if kind in ("cuda", "rocm"):
        for i in range(torch.cuda.device_count()):
            lines.append(f"device {i}          : {torch.cuda.get_device_name(i)}")
    else:
        lines.append("devices           : none (host tensors only)")
    from . import device as devices

    lines.append(f"native backends   : cpu -> {devices.native_backend('cpu')}"
                 + (f", cuda -> {devices.native_backend('cuda')}"
                    f" ({'RCCL' if kind == 'rocm' else 'NCCL'})" if kind in ("cuda", "rocm") else ""))
    if kind in ("cuda", "rocm"):
        seam = devices.seam("cuda")
        lines.append(f"native library    : {seam.native_library_path() or 'not found'} "
                     f"({seam.native_library[1]}, {seam.vendor})")
    if kind in ("cuda", "rocm"):
        try:
            ops = devices.seam("cuda").runtime()
            memops = ops.stream_mem_ops(torch.cuda.current_device())
            lines.append(f"device data path  : engine copies through {ops.name} runtime; stream "
                         f"memory operations {'yes (issue never blocks)' if memops else 'NO: the issuing thread drives device copies (blocking)'}")
        except Exception as e:  # noqa: BLE001 - report, do not fail the doctor
            lines.append(f"device data path  : vendor runtime not usable: {e}")
    names = transport_names()
    lines.extend(transport_report(kind))
    try:
        import libucx  # noqa: F401
        ucx = "libucx wheel importable"
    except ImportError:
        ucx = "libucx wheel not installed (pip install hetccl[ucx])"
    lines.append(f"UCX               : {'built in' if 'ucx' in names else 'not built'}; {ucx}")
    from . import rdma
    lines.extend(rdma.report(kind))  # RDMA devices, GPU memory registration, UCX per vendor
    lines.extend(dropin_report())
    lines.append(f"host identity     : {vendor.host_identity()}")
    lines.append("settings:")
    for name, value, is_set, doc in config.table():
        mark = "*" if is_set else " "
        lines.append(f"  {mark} {name:<22} = {value!r:<12} {doc.splitlines()[0][:70]}")
    lines.append("  (* = set in the environment)")
    return lines


def dropin_report() -> list[str]:
    """The drop-in NCCL: built or not, active in this process's environment (LD_PRELOAD), the
    real library it forwards to, and the line to add for a launcher other than `hetccl run`."""
    from . import nccl_dropin

    try:
        lib = nccl_dropin.library_path("nccl")
    except FileNotFoundError as e:
        return [f"drop-in NCCL      : not built ({e})"]
    active = lib in os.environ.get("LD_PRELOAD", "").split(":")
    real = nccl_dropin.real_library("nccl")
    out = [f"drop-in NCCL      : {lib} ({'ACTIVE: preloaded here' if active else 'not active here'})",
           f"  forwards to     : {real or 'no real libnccl.so.2 found (one-vendor communicators then fail; set HETCCL_NCCL_LIBRARY)'}",
           f"  for any launcher: LD_PRELOAD={lib} HETCCL_NCCL_LIBRARY={real or '<path of the real libnccl.so.2>'}",
           "  (or: hetccl run --dropin ...; RCCL: " + nccl_dropin.SONAMES["rccl"] + " beside it, HETCCL_RCCL_LIBRARY)"]
    return out


def transport_report(kind: str) -> list[str]:
    """The capability table (csrc/*_transport.cc, most preferred first) and what a peer of this
    build would get on this host and on another host (hetccl/transports.py)."""
    from . import config, transports

    table = transports.local_table()
    lines = ["bridge transports (capability table, most preferred first):"]
    for t in table:
        reach = "+".join(w for w, ok in (("this host", t["same_host"]),
                                         ("other hosts", t["other_host"])) if ok) or "nothing"
        lines.append(f"  {t['name']:<4} pref {t['preference']:<3} reaches {reach:<21} memory "
                     f"{','.join(t['memory']):<10} {t['detail']}")
    mine = transports.publishable(table)
    forced = config.get("HETCCL_TRANSPORT")
    device = config.get("HETCCL_UCX_DEVICE")
    for same in (True, False):
        where = "peers on this host " if same else "peers on other hosts"
        try:
            c = transports.choose(0, 1, mine, mine, same, forced, kind, kind, device)
            got = c.transport + (", device memory direct" if c.device_direct else
                                 ", device data host-staged" if kind in ("cuda", "rocm") else "")
            if (not c.device_direct and device == "auto" and not same
                    and kind in mine[c.transport]["memory"]):
                got += (f" ({c.transport} takes {kind} memory, but would call the runtime off "
                        "the issuing thread: direct needs a runtime-free device path and a "
                        "peer-memory module; HETCCL_UCX_DEVICE=force overrides, see "
                        "docs/transports.md)")
        except ValueError as e:
            got = f"NONE: {e}"
        lines.append(f"  {where} -> {got}" + (" (HETCCL_EMULATE_HOSTS: every vendor group is a "
                                                "host of its own)" if same and config.get(
                                                    "HETCCL_EMULATE_HOSTS") else ""))
    return lines


def copy_test(nbytes: int = 256 << 20) -> list[str]:
    """PCIe copy rates per device: torch pinned memory vs a shared-memory mapping registered
    the way the engine registers its zero-copy slots (the device seam's runtime)."""
    import ctypes
    import mmap
    import time

    from . import device as devices

    lines = []
    rt = devices.seam("cuda").runtime()
    for i in range(torch.cuda.device_count()):
        dev = torch.device("cuda", i)
        torch.cuda.set_device(dev)
        d = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED)
        base = ctypes.addressof(ctypes.c_char.from_buffer(m))
        shm = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(base), dtype=torch.uint8)
        shm.fill_(1)
        ok = rt.host_register(base, nbytes)
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        res = []
        for name, h in (("pinned", pinned), ("shm registered" if ok else "shm NOT registered", shm)):
            for direction in ("D2H", "H2D"):
                src, dst = (d, h) if direction == "D2H" else (h, d)
                dst.copy_(src, non_blocking=True)
                torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                for _ in range(5):
                    dst.copy_(src, non_blocking=True)
                torch.cuda.synchronize(dev)
                res.append(f"{name} {direction} {5 * nbytes / (time.perf_counter() - t0) / 1e9:.1f}")
        if ok:
            rt.host_unregister(base)
        del shm
        m.close()
        lines.append(f"device {i} copy GB/s: " + ", ".join(res))
    n = torch.cuda.device_count()
    if n > 1:
        # all devices at once: devices behind one PCIe switch share its uplink
        devs = [torch.device("cuda", i) for i in range(n)]
        d = [torch.empty(nbytes, dtype=torch.uint8, device=x) for x in devs]
        h = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in devs]
        h2 = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in devs]
        d2 = [torch.empty(nbytes, dtype=torch.uint8, device=x) for x in devs]
        streams = [(torch.cuda.Stream(device=x), torch.cuda.Stream(device=x)) for x in devs]
        res = []
        for mode in ("D2H", "H2D", "D2H+H2D"):
            for x in devs:
                torch.cuda.synchronize(x)
            t0 = time.perf_counter()
            for _ in range(5):
                for i in range(n):
                    if "D2H" in mode:
                        with torch.cuda.stream(streams[i][0]):
                            h[i].copy_(d[i], non_blocking=True)
                    if "H2D" in mode:
                        with torch.cuda.stream(streams[i][1]):
                            d2[i].copy_(h2[i], non_blocking=True)
            for x in devs:
                torch.cuda.synchronize(x)
            per = 5 * nbytes / (time.perf_counter() - t0) / 1e9
            res.append(f"{mode} {per:.1f} per device and direction")
        lines.append(f"all {n} devices at once, GB/s: " + ", ".join(res))
    return lines


def _rank(ctx) -> str:
    import torch.distributed as dist

    import hetccl

    dist.init_process_group("hetccl", init_method=ctx.init_method(), rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=60))
    pg = dist.group.WORLD
    if isinstance(pg, hetccl.HetcclProcessGroup):
        topo = pg.topo
        b = pg.engine.bridge
        peers = ", ".join(f"{p}:{b.choices[(ctx.rank, p)].describe()}" for p in b.peers)
        ucx = b.info.get("ucx")
        if ucx:
            peers += f" [UCX_TLS={ucx['tls']}, lanes {ucx['lanes']}, resources {ucx['resources']}]"
        line = (f"rank {ctx.rank}: vendor {topo.labels[topo.my_group]} (group "
                f"{topo.my_group}, local rank {topo.local_rank}/{topo.local_size}); "
                f"native {'gloo' if topo.local_size > 1 else '-'}; bridge peers {peers}")
    else:
        line = f"rank {ctx.rank}: single-vendor group -> native pass-through ({type(pg).__name__})"
    x = torch.ones(4)
    dist.all_reduce(x)
    ok = bool((x == ctx.world_size).all())
    dist.destroy_process_group()
    return line + f"; all_reduce check {'ok' if ok else 'WRONG'}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hetccl doctor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--launch", metavar="SPLIT", default=None,
                   help="also start a local group with this vendor split (e.g. 2+2)")
    p.add_argument("--copy-test", action="store_true",
                   help="measure D2H/H2D rates to pinned and registered shared memory")
    args = p.parse_args(argv)
    print("hetccl doctor")
    for line in local_report():
        print("  " + line)
    if args.copy_test:
        for line in copy_test():
            print("  " + line)
    if args.launch:
        from .launch import spawn

        world = sum(int(x) for x in args.launch.split("+"))
        print(f"\nlocal group, vendors {args.launch}:")
        for line in spawn(_rank, world, vendors=args.launch, timeout=120):
            print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
