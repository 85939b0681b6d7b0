"""Nothing vendor-specific outside the device seam: the library's code (hetccl/ minus
hetccl/device/, csrc/ minus the runtime modules csrc/device/) names no vendor, vendor API or
vendor library -- torch.cuda, is_cuda, CUDA, ROCm, HIP, NCCL, RCCL, AMD, NVIDIA, XPU -- outside
comments and docstrings, except in the files of ALLOWED, each with its reason. Adding a vendor
then touches hetccl/device/ and csrc/device/ only.

Also checks the seam's own facts: one name for AMD (vendor label "amd", build and memory type
"rocm", "hip" only for the runtime API), and each seam's runtime / native library names.
"""
from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VENDOR = re.compile(r"(?i)(torch\.cuda|\bis_cuda\b|\bis_rocm\b|\bcuda\w*|\brocm\w*|\bhip\w*"
                    r"|\bnccl\w*|\brccl\w*|\bamd\w*|\bnvidia\b|\bxpu\b)")

# file or folder (relative to the repository root) -> why it may name a vendor
ALLOWED = {
    "hetccl/bench": "benchmark and profiling tools: CUDA-specific tools (torch.cuda timing and "
                    "devices), not part of the communication library",
    "hetccl/balance": "the balancer's measurement tools (torch.cuda memory and timing on GPUs)",
    "hetccl/doctor.py": "the doctor's report: it names the torch build (cuda/hip versions), the "
                        "GPUs and their native library to the user, and probes copies with "
                        "torch.cuda",
    "hetccl/rdma.py": "the doctor's RDMA readiness report: it names vendor kernel modules "
                      "(nvidia_peermem, amdgpu), the CUDA driver attribute for dma-buf and which "
                      "vendor a loaded UCX build serves (UCX issue 8764) to the user",
    "hetccl/shim.py": "redirects what user scripts call by its vendor name: "
                      "init_process_group('nccl'), torch.cuda.set_device(device_id), "
                      "Megatron's model_parallel_cuda_manual_seed, accelerate's CPU switch",
    "hetccl/run.py": "its help text names the 'nccl' backend that scripts call",
    "hetccl/config.py": "help text of the settings: the detected vendor labels, NCCL's analogous "
                        "variables, UCX's cuda_copy",
    "csrc/nccl": "the drop-in NCCL/RCCL: NCCL's ABI names are what it implements, and each "
                 "flavour states which vendor a process that loads it is (libnccl: nvidia, its "
                 "runtime cuda; librccl: amd, hip) and the real library it stands in front of",
    "hetccl/nccl_dropin.py": "the drop-in's locator: the sonames it stands in for, the real "
                             "libraries behind them (the nvidia-nccl wheel), NCCL's ABI names",
    "csrc/ucx_transport.cc": "UCX's own names of vendor memory types and transports "
                             "(UCS_MEMORY_TYPE_CUDA / _ROCM, cuda_copy, rocm_copy); the memory "
                             "type string itself comes from the device runtime",
}
SEAM = ("hetccl/device/", "csrc/device/", "csrc/device_ops.h")


def _allowed(rel: str) -> bool:
    return any(rel == a or rel.startswith(a + "/") for a in ALLOWED)


def _python_code(text: str) -> list[tuple[int, str]]:
    """(line, token) of every name and string token that is not a comment or a docstring."""
    out, prev = [], tokenize.NEWLINE
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.STRING and prev in (tokenize.NEWLINE, tokenize.NL, tokenize.INDENT,
                                                    tokenize.DEDENT, tokenize.ENCODING):
            prev = tok.type
            continue  # a docstring (a string statement)
        if tok.type in (tokenize.NAME, tokenize.STRING, tokenize.OP, tokenize.FSTRING_MIDDLE
                        if hasattr(tokenize, "FSTRING_MIDDLE") else tokenize.STRING):
            out.append((tok.start[0], tok.string))
        if tok.type not in (tokenize.COMMENT, tokenize.NL):
            prev = tok.type
    return out


def _cpp_code(text: str) -> list[tuple[int, str]]:
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    return [(i + 1, re.sub(r"//.*", "", line)) for i, line in enumerate(text.splitlines())]


def _offenders() -> dict[str, list[str]]:
    found = {}
    files = sorted((ROOT / "hetccl").rglob("*.py")) + sorted((ROOT / "csrc").rglob("*.cc")) + \
        sorted((ROOT / "csrc").rglob("*.h"))
    for f in files:
        rel = f.relative_to(ROOT).as_posix()
        if rel.startswith(SEAM) or _allowed(rel):
            continue
        text = f.read_text()
        code = _python_code(text) if f.suffix == ".py" else _cpp_code(text)
        # a Python line's tokens joined twice: with spaces (so a name after a keyword, as in
        # "import cuda", keeps its word boundary) and without (so "torch . cuda" reads as
        # torch.cuda)
        spaced: dict[int, str] = {}
        for n, s in code:
            spaced[n] = spaced.get(n, "") + " " + s
        hits = [f"{n}: {s.strip()[:100]}" for n, s in sorted(spaced.items())
                if VENDOR.search(s) or VENDOR.search(s.replace(" ", ""))]
        if hits:
            found[rel] = hits
    return found


def test_no_vendor_names_outside_the_seam():
    found = _offenders()
    assert not found, "vendor names outside hetccl/device/ and csrc/device/ (move them behind " \
        "the seam, or add the file to ALLOWED with its reason):\n" + \
        "\n".join(f"{f}\n    " + "\n    ".join(h) for f, h in found.items())


def test_the_grep_finds_what_it_should():
    """The scanner is not blind: code naming a vendor is found, a comment or docstring is not."""
    src = '"""NCCL docstring."""\nimport torch\n# rocm comment\nx = torch.cuda.is_available()\n' \
          'y = t.is_cuda\nname = "rccl"\n'
    lines = {n for n, s in _python_code(src) if VENDOR.search(s)}
    assert lines == {4, 5, 6}
    cpp = '// cuda comment\nint a; /* hip\n block */ int b = hipSetDevice;\nauto m = "rocm";\n'
    assert {n for n, s in _cpp_code(cpp) if VENDOR.search(s)} == {3, 4}


def test_allowed_entries_exist_and_still_need_it():
    """Every allow-list entry names a real path that still names a vendor (else drop it)."""
    for rel in ALLOWED:
        p = ROOT / rel
        assert p.exists(), f"ALLOWED names {rel}, which does not exist"
        files = [p] if p.is_file() else [f for f in p.rglob("*") if f.suffix in (".py", ".cc", ".h")]
        assert any(VENDOR.search(f.read_text()) for f in files), f"{rel} no longer needs ALLOWED"


def test_one_name_for_amd():
    from hetccl.device.cuda import CudaSeam
    from hetccl.device.host import HostSeam
    from hetccl.device.rocm import RocmSeam

    assert (RocmSeam.vendor, RocmSeam.build, RocmSeam.memory_type) == ("amd", "rocm", "rocm")
    assert (RocmSeam.runtime_name, RocmSeam.native_library) == ("hip", ("librccl.so", "librccl.so.1"))
    assert (CudaSeam.vendor, CudaSeam.build, CudaSeam.memory_type) == ("nvidia", "cuda", "cuda")
    assert (CudaSeam.runtime_name, CudaSeam.native_library) == ("cuda", ("libnccl.so", "libnccl.so.2"))
    assert (HostSeam.vendor, HostSeam.build, HostSeam.memory_type) == ("host", "cpu", "host")
    # ROCm builds serve torch's "cuda" device type: same device code, so an NVIDIA and an AMD
    # rank's headers agree on the device type of their GPU tensors
    assert RocmSeam.type == CudaSeam.type == "cuda" and RocmSeam.device_code == CudaSeam.device_code
    assert RocmSeam.build_matches() != CudaSeam.build_matches()
    # the C++ runtimes name their memory as the Python seams do
    from hetccl._core import _C
    assert _C.device_ops("emulated").memory_type == HostSeam.memory_type


@pytest.mark.parametrize("path", ["hetccl/device/rocm.py", "csrc/device/hip_ops.cc"])
def test_amd_modules_name_no_other_label(path):
    """'amd' is the vendor label; no module calls AMD by another label (e.g. 'radeon')."""
    text = (ROOT / path).read_text()
    assert not re.search(r'"(radeon|ati|amdgpu)"', text)
