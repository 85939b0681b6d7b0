"""One place for settings: the library (hetccl/, integrations/) reads HETCCL_* environment
variables only through hetccl/config.py's table, except in the modules of DIRECT, which import
nothing of hetccl and read theirs directly; every HETCCL_* name read anywhere is declared in the
table (so `hetccl doctor` lists it). Writing a setting for a child process (launchers) is fine.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from hetccl import config

ROOT = Path(__file__).resolve().parent.parent
# os.environ.get("HETCCL_X"), os.getenv("HETCCL_X"), os.environ["HETCCL_X"] (not assigned),
# "HETCCL_X" in os.environ
READ = re.compile(r"""(?:environ\.get|getenv)\(\s*["'](HETCCL_\w+)["']"""
                  r"""|environ\[\s*["'](HETCCL_\w+)["']\s*\](?!\s*=[^=])"""
                  r"""|["'](HETCCL_\w+)["']\s+(?:not\s+)?in\s+os\.environ""")

# file (relative to the repository root) -> why it reads its variables directly
DIRECT = {
    "hetccl/config.py": "the table itself",
    "hetccl/capi.py": "the C API's ctypes binding imports nothing of hetccl (torch-free harness "
                      "ranks load it by path): HETCCL_CAPI_LIB",
    "hetccl/nccl_dropin.py": "imports neither torch nor the rest of hetccl (`hetccl run --dropin`, "
                             "doctor, tests): HETCCL_NCCL_LIBRARY / HETCCL_RCCL_LIBRARY (through "
                             "REAL_ENV), HETCCL_NCCL_H",
}


def _reads(text: str) -> list[str]:
    return [next(g for g in m.groups() if g) for m in READ.finditer(text)]


def _files():
    for folder in ("hetccl", "integrations"):
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_the_pattern_finds_reads_and_skips_writes():
    src = ('a = os.environ.get("HETCCL_A")\nb = os.getenv(\'HETCCL_B\', "")\n'
           'c = os.environ["HETCCL_C"]\nif "HETCCL_D" in os.environ: pass\n'
           'os.environ["HETCCL_E"] = "1"\nenv = dict(os.environ, HETCCL_F="x")\n'
           'ok = os.environ["HETCCL_G"] == "1"\n')
    assert _reads(src) == ["HETCCL_A", "HETCCL_B", "HETCCL_C", "HETCCL_D", "HETCCL_G"]


def test_settings_are_read_through_config():
    stray = {}
    for f in _files():
        rel = f.relative_to(ROOT).as_posix()
        if rel in DIRECT:
            continue
        names = _reads(f.read_text())
        if names:
            stray[rel] = names
    assert not stray, f"read config.get(NAME) instead (hetccl/config.py): {stray}"


def test_every_name_read_is_declared():
    read = {n for f in _files() for n in _reads(f.read_text())}
    from hetccl import nccl_dropin
    read |= set(nccl_dropin.REAL_ENV.values())
    assert read, "the scan found nothing"
    assert read <= set(config.SETTINGS), read - set(config.SETTINGS)


def test_direct_entries_exist_and_still_need_it():
    for rel in DIRECT:
        if rel == "hetccl/config.py":
            continue
        p = ROOT / rel
        assert p.exists(), rel
        assert _reads(p.read_text()) or rel == "hetccl/nccl_dropin.py" and "REAL_ENV" in p.read_text(), \
            f"{rel} reads no HETCCL_* variable any more: drop it from DIRECT"


def test_sizes_parse_as_users_write_them():
    """config.parse_size: the one parser of byte sizes (settings, the benchmarks' --sizes)."""
    cases = {"4096": 4096, "512K": 512 << 10, "1M": 1 << 20, "1.5G": 3 << 29, "64MiB": 64 << 20,
             "2mb": 2 << 20, " 8k ": 8 << 10, "0": 0}
    assert {s: config.parse_size(s) for s in cases} == cases
    for bad in ("", "M", "lots", "1T"):
        with pytest.raises(ValueError):
            config.parse_size(bad)
