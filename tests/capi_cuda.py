"""The C API's collective cases (tests/capi_worker.py) on CUDA memory, for the GPU box: a rank
process with torch, whose communicator wrapper (CudaComm) copies each call's numpy arrays into
device buffers, runs the call on a CUDA stream, and copies every buffer back at the next wait.
So the same cases, references and digests as the CPU tests run through the CUDA runtime module,
hetccl's device kernels (csrc/device/kernels/reduce_kernels.cu) and the device route's engine
plans (csrc/api/device_route.h) -- or the staged route, by HETCCL_STREAM_DEVICE_BYTES.

  python3 tests/capi_cuda.py <job.json>   (tests/test_gpu_capi.py writes the job files)
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


class CudaComm:
    """capi.Comm's collective and point-to-point methods on CUDA copies of numpy arrays. Arrays
    that lie inside another array of the same call (in-place layouts: all_gather's send block in
    recv, reduce_scatter's recv block in send) map to the same offset of the other's device copy.
    Every call goes on this wrapper's CUDA stream; stream_sync waits for it and copies each
    buffer of the calls since the last wait back into its numpy array (a buffer the call must
    not write comes back unchanged, which the cases check)."""

    def __init__(self, comm, torch, device="cuda"):
        self.comm, self.torch, self.device = comm, torch, device
        if device == "cuda":
            self.stream = torch.cuda.Stream()
            self.handle = self.stream.cuda_stream
            self.wait = self.stream.synchronize
        else:  # the harness itself on the CPU machine: CPU tensors, the emulated runtime's stream
            self.handle = comm.stream_create()
            self.wait = lambda: comm.stream_sync(self.handle)
        self.pending: list = []   # (numpy root, device tensor), copied back at the next wait
        self.scalars: list = []   # PreMulSum device scalars: (numpy array, device tensor)

    def __getattr__(self, name):
        return getattr(self.comm, name)

    def _map(self, arrays):
        torch = self.torch
        live = [a for a in arrays if a is not None]
        ptr = {id(a): a.__array_interface__["data"][0] for a in live}
        roots: list = []
        for a in sorted(live, key=lambda a: -a.nbytes):
            p = ptr[id(a)]
            for r, t in roots:
                q = ptr[id(r)]
                if q <= p and p + a.nbytes <= q + r.nbytes:
                    break
            else:
                flat = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
                t = torch.empty(max(1, flat.size), dtype=torch.uint8, device=self.device)
                if flat.size:
                    t[:flat.size].copy_(torch.from_numpy(flat.copy()))
                roots.append((a, t))
        self._host_sync()  # the copies above ran on torch's current stream
        out = []
        for a in arrays:
            if a is None:
                out.append(None)
                continue
            p = ptr[id(a)]
            for r, t in roots:
                q = ptr[id(r)]
                if q <= p and p + a.nbytes <= q + r.nbytes:
                    out.append(t.data_ptr() + (p - q))
                    break
        self.pending.extend(roots)
        return out

    def _call(self, name, arrays, *rest):
        for a, t in self.scalars:  # a device scalar is read when the call runs
            t.copy_(self.torch.from_numpy(a.view(np.uint8).copy()))
        self._host_sync()
        getattr(self.comm, name)(*self._map(arrays), *rest, stream=self.handle)

    def all_reduce(self, send, recv, count, dtype="float32", op="sum", stream=None):
        self._call("all_reduce", [send, recv], count, dtype, op)

    def reduce(self, send, recv, count, dtype="float32", op="sum", root=0, stream=None):
        self._call("reduce", [send, recv], count, dtype, op, root)

    def broadcast(self, send, recv, count, dtype="float32", root=0, stream=None):
        self._call("broadcast", [send, recv], count, dtype, root)

    def all_gather(self, send, recv, sendcount, dtype="float32", stream=None):
        self._call("all_gather", [send, recv], sendcount, dtype)

    def reduce_scatter(self, send, recv, recvcount, dtype="float32", op="sum", stream=None):
        self._call("reduce_scatter", [send, recv], recvcount, dtype, op)

    def all_to_all(self, send, recv, count, dtype="float32", stream=None):
        self._call("all_to_all", [send, recv], count, dtype)

    def send(self, buf, count, dtype, peer, stream=None):
        self._call("send", [buf], count, dtype, peer)

    def recv(self, buf, count, dtype, peer, stream=None):
        self._call("recv", [buf], count, dtype, peer)

    def premul_sum(self, scalar, dtype, device=False):
        if not device:
            return self.comm.premul_sum(scalar, dtype)
        t = self.torch.from_numpy(scalar.view(np.uint8).copy()).to(self.device)
        self.scalars.append((scalar, t))
        return self.comm.premul_sum(t.data_ptr(), dtype, device=True)

    def _host_sync(self):
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def stream_sync(self, stream=None):
        self.wait()
        for a, t in self.pending:
            flat = a.view(np.uint8).reshape(-1)
            if flat.size:
                flat[:] = t[:flat.size].cpu().numpy()
        self.pending.clear()


def run(cfg):
    import torch

    import capi_worker as w

    w.capi = w.load_capi()
    capi = w.capi
    rank, n = cfg["rank"], cfg["n"]
    dev = cfg.get("device", "cuda")
    if dev == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    w.LABELS[:] = cfg.get("labels", [])
    comm = capi.Comm(n, bytes.fromhex(cfg["uid"]), rank)
    cc = CudaComm(comm, torch, dev)
    res = w.run_cases(cc, rank, n, stream=cc.handle)
    out = res["cases"]

    def case(name, fn):
        w.record_case(out, name, fn)

    def burst():
        """40 calls of 1 MiB in flight on one stream before one wait."""
        xs = [torch.full((1 << 18,), float(rank + k), device=dev) for k in range(40)]
        cc._host_sync()
        for x in xs:
            comm.all_reduce(x.data_ptr(), x.data_ptr(), x.numel(), "float32", "sum", stream=cc.handle)
        cc.wait()
        for k, x in enumerate(xs):
            want = sum(r + k for r in range(n))
            if not bool((x == want).all()):
                return f"call {k} of 40 in flight: {x[:3].tolist()} != {want}"
        return None

    def mixed():
        """Even ranks: host memory, no stream; odd ranks: device memory on a stream. Every rank
        then runs the call staged (the device route's ranks on their route's stream)."""
        m = 1 << 17
        if rank % 2:
            x = torch.full((m,), float(rank + 1), device=dev)
            cc._host_sync()
            comm.all_reduce(x.data_ptr(), x.data_ptr(), m, "float32", "sum", stream=cc.handle)
            cc.wait()
            got = x.cpu().numpy()
        else:
            got = np.full(m, float(rank + 1), np.float32)
            comm.all_reduce(got, got, m, "float32", "sum")
        return None if np.all(got == n * (n + 1) / 2) else "host and device ranks disagree"

    case("cuda/burst40", burst)
    case("cuda/mixed_host_and_device", mixed)
    res["info"] = comm.info()
    comm.destroy()
    return res


def main():
    cfg = json.load(open(sys.argv[1]))
    t0 = time.time()
    res = run(cfg)
    res["wall_s"] = time.time() - t0
    with open(cfg["out"], "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
