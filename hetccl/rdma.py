"""RDMA readiness for `hetccl doctor`: RDMA devices (through pyverbs), whether GPU memory can be
registered for RDMA, and which UCX this process loads and what it offers.

pyverbs is rdma-core's Python binding. It is not on PyPI in a form that builds here (the sdist
rebuilds all of rdma-core); it comes from the system: Debian/Ubuntu `apt-get install
python3-pyverbs` (RHEL: `dnf install python3-pyverbs`), built for the system's Python, so it
imports only under that interpreter (/usr/bin/python3; a venv made with
`--system-site-packages` from it sees it too). Every function here returns lines and never
raises: no pyverbs, no device, or a kernel without RDMA support (ibv_get_device_list fails
with ENOSYS) is one line saying so.

UCX and vendors: a UCX build supports CUDA or ROCm, not both (UCX issue 8764), so each vendor's
processes must load their own UCX (the CUDA one from the libucx-cu* wheel or HPC-X; ROCm's UCX
for AMD). `ucx_lines` names the libucp this process loaded, its transport modules, the memory
types its context handles, and says when they do not match the device this process's torch
drives.
"""
from __future__ import annotations

import errno as _errno
import glob
import os

#: kernel modules that let an RDMA NIC reach GPU memory without dma-buf (peer memory clients)
PEER_MEMORY_MODULES = ("nvidia_peermem", "nv_peer_mem", "amdp2p", "ib_peer_mem")
_PORT_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
_LINK_LAYERS = {0: "unspecified", 1: "InfiniBand", 2: "Ethernet"}
_GID_TYPES = {0: "IB/RoCE v1", 1: "RoCE v2"}
_MAX_GIDS = 8  # GIDs listed per port (non-zero ones)


def _import_pyverbs():
    """pyverbs.device, or the ImportError's text."""
    try:
        import pyverbs.device as d  # noqa: PLC0415 - optional system package
        return d, ""
    except ImportError as e:
        return None, str(e)


def _verbs_errno() -> int:
    """errno of a direct ibv_get_device_list call (pyverbs reports only -1 when it fails), or 0."""
    import ctypes
    try:
        lib = ctypes.CDLL("libibverbs.so.1", use_errno=True)
    except OSError:
        return 0
    lib.ibv_get_device_list.restype = ctypes.c_void_p
    n = ctypes.c_int(0)
    ctypes.set_errno(0)
    p = lib.ibv_get_device_list(ctypes.byref(n))
    if p:
        lib.ibv_free_device_list.argtypes = [ctypes.c_void_p]
        lib.ibv_free_device_list(p)
        return 0
    return ctypes.get_errno()


def _rdma_error_text(e: Exception, listing: bool = False) -> str:
    code = getattr(e, "error_code", None)
    if code is None:
        code = getattr(e, "errno", None)
    if listing and not (isinstance(code, int) and code > 0):
        code = _verbs_errno() or code
    if isinstance(code, int) and code > 0:
        name = _errno.errorcode.get(code, str(code))
        why = " (kernel without InfiniBand/RDMA support)" if code == _errno.ENOSYS else ""
        return f"{name}: {os.strerror(code)}{why}"
    return f"{type(e).__name__}: {e}"


def rdma_lines(pyverbs_device=None) -> list[str]:
    """RDMA devices, their ports (state, link layer) and GIDs. ``pyverbs_device``: the
    pyverbs.device module (tests pass a fake one); None imports it."""
    d = pyverbs_device
    if d is None:
        d, err = _import_pyverbs()
        if d is None:
            return [f"RDMA devices      : not listed: pyverbs not importable ({err}); install the "
                    "system's python3-pyverbs (rdma-core) and run the doctor under the system "
                    "Python (docs/transports.md, RDMA readiness)"]
    try:
        devs = list(d.get_device_list())
    except Exception as e:  # noqa: BLE001 - PyverbsRDMAError and friends
        return [f"RDMA devices      : none (ibv_get_device_list failed: "
                f"{_rdma_error_text(e, listing=True)})"]
    if not devs:
        return ["RDMA devices      : none (rdma-core sees no RDMA device)"]
    lines = [f"RDMA devices      : {len(devs)}"]
    for dev in devs:
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        try:
            ctx = d.Context(name=name)
        except Exception as e:  # noqa: BLE001
            lines.append(f"  {name}: cannot open ({_rdma_error_text(e)})")
            continue
        try:
            attr = ctx.query_device()
            lines.append(f"  {name}: fw {attr.fw_version}, {attr.phys_port_cnt} port(s)")
            for port in range(1, attr.phys_port_cnt + 1):
                pa = ctx.query_port(port)
                gids = []
                for idx in range(min(int(pa.gid_tbl_len), 64)):
                    try:
                        gid = str(ctx.query_gid(port, idx))
                    except Exception:  # noqa: BLE001 - sparse tables: holes fail
                        continue
                    if set(gid) <= set("0:"):
                        continue
                    try:
                        kind = _GID_TYPES.get(int(ctx.query_gid_type(port, idx)), "?")
                    except Exception:  # noqa: BLE001 - IB ports, old rdma-core
                        kind = ""
                    gids.append(f"[{idx}] {gid}" + (f" ({kind})" if kind else ""))
                    if len(gids) >= _MAX_GIDS:
                        break
                lines.append(f"    port {port}: {_PORT_STATES.get(int(pa.state), pa.state)}, link "
                             f"layer {_LINK_LAYERS.get(int(pa.link_layer), pa.link_layer)}, GIDs "
                             + ("; ".join(gids) if gids else "none"))
        except Exception as e:  # noqa: BLE001
            lines.append(f"  {name}: query failed ({_rdma_error_text(e)})")
        finally:
            try:
                ctx.close()
            except Exception:  # noqa: BLE001
                pass
    return lines


def loaded_modules(proc_modules: str = "/proc/modules", sys_module: str = "/sys/module") -> set:
    """Names of the loaded kernel modules (/proc/modules, else /sys/module)."""
    names = set()
    try:
        with open(proc_modules) as f:
            names.update(line.split()[0] for line in f if line.strip())
    except OSError:
        pass
    if os.path.isdir(sys_module):
        names.update(os.listdir(sys_module))
    return names


def _cuda_dmabuf_supported():
    """CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED of device 0 through the driver, or None."""
    import ctypes
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    v, dev = ctypes.c_int(0), ctypes.c_int(0)
    if cu.cuInit(0) != 0 or cu.cuDeviceGet(ctypes.byref(dev), 0) != 0:
        return None
    if cu.cuDeviceGetAttribute(ctypes.byref(v), 124, dev) != 0:  # DMA_BUF_SUPPORTED
        return None
    return bool(v.value)


def gpu_rdma_lines(kind: str, modules: set | None = None, dmabuf=None) -> list[str]:
    """Whether an RDMA NIC can register this process's GPU memory: dma-buf (CUDA: the driver's
    device attribute; ROCm: amdgpu exports dma-buf, kernel 5.12+) or a peer-memory module."""
    if kind not in ("cuda", "rocm"):
        return ["GPU memory RDMA   : no GPU in this process (host memory only)"]
    mods = loaded_modules() if modules is None else modules
    peer = [m for m in PEER_MEMORY_MODULES if m in mods]
    if kind == "cuda":
        db = _cuda_dmabuf_supported() if dmabuf is None else dmabuf
        dtext = {True: "yes", False: "no", None: "unknown (driver not queried)"}[db]
    else:
        dtext = "via amdgpu (loaded)" if "amdgpu" in mods else "unknown (amdgpu not loaded)"
    ptext = ", ".join(peer) + " loaded" if peer else \
        f"none loaded ({', '.join(PEER_MEMORY_MODULES)})"
    ok = dtext.startswith(("yes", "via")) or bool(peer)
    return [f"GPU memory RDMA   : dma-buf {dtext}; peer-memory modules: {ptext} -> "
            + ("GPUDirect RDMA possible where the NIC and UCX support it" if ok else
               "GPU memory cannot be registered for RDMA: device data goes through host memory")]


def loaded_library(stem: str, maps: str = "/proc/self/maps") -> str:
    """Path of the loaded shared object whose name starts with ``stem`` (e.g. "libucp."), or ""."""
    try:
        with open(maps) as f:
            for line in f:
                path = line.split()[-1] if line.strip() else ""
                if os.path.basename(path).startswith(stem):
                    return path
    except OSError:
        pass
    return ""


def ucx_module_names(libucp: str) -> list[str]:
    """UCX's transport modules next to a libucp (lib/ucx/libuct_<x>.so): which transports and
    memory types that build can load (cuda, rocm, ib, ...)."""
    if not libucp:
        return []
    mods = glob.glob(os.path.join(os.path.dirname(libucp), "ucx", "libuct_*.so*"))
    return sorted({os.path.basename(m).split(".so")[0][len("libuct_"):] for m in mods})


def ucx_lines(kind: str, table=None, libucp: str | None = None, modules=None) -> list[str]:
    """Which UCX this process loads and what it offers, and whether it fits the vendor: a UCX
    build is for CUDA or for ROCm (UCX issue 8764), so each vendor's processes load their own."""
    from . import transports
    entry = next((t for t in (table if table is not None else transports.local_table())
                  if t["name"] == "ucx"), None)
    if entry is None:
        return ["UCX library      : not built into hetccl._C (no ucx transport)"]
    path = loaded_library("libucp.") if libucp is None else libucp
    mods = ucx_module_names(path) if modules is None else modules
    mem = [m for m in entry["memory"] if m != "host"]
    lines = [f"UCX library       : {path or 'libucp not found in this process'}; loadable modules "
             f"{','.join(mods) or 'none found'}; memory {','.join(entry['memory'])}; "
             f"{entry['detail']}"]
    has_cuda_mod = any(m.startswith("cuda") for m in mods)
    has_rocm_mod = any(m.startswith("rocm") for m in mods)
    want = {"cuda": "cuda", "rocm": "rocm"}.get(kind)
    if want is None:
        lines.append("UCX for vendor    : host process: any UCX build serves host memory")
    elif want in mem:
        lines.append(f"UCX for vendor    : matches this process's {want} device (UCX handles "
                     f"{want} memory)")
    else:
        other = "rocm" if want == "cuda" else "cuda"
        built = ((has_cuda_mod and want == "cuda") or (has_rocm_mod and want == "rocm"))
        why = (f"its {want} module is there but found no {want} driver in this process" if built
               else f"this UCX is built for {other if (has_cuda_mod or has_rocm_mod) else 'no GPU'}")
        lines.append(f"UCX for vendor    : MISMATCH: torch drives {want} but {why}; a UCX build "
                     f"supports CUDA or ROCm, not both (UCX issue 8764): load a {want} UCX in "
                     f"this vendor's processes ({'libucx-cu13 / HPC-X' if want == 'cuda' else 'ROCm UCX'}; "
                     "RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true to prefer the system's). Device "
                     "data is host-staged meanwhile")
    return lines


def report(kind: str) -> list[str]:
    """All RDMA-readiness lines for `hetccl doctor` (never raises)."""
    out = []
    for fn in (rdma_lines, lambda: gpu_rdma_lines(kind), lambda: ucx_lines(kind)):
        try:
            out.extend(fn())
        except Exception as e:  # noqa: BLE001 - a doctor reports, it does not fail
            out.append(f"RDMA/UCX check failed: {type(e).__name__}: {e}")
    return out
