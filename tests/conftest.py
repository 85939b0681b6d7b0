import glob
import os
import shutil

import pytest


def _hetccl_shm():
    return set(glob.glob("/dev/shm/hetccl*"))


@pytest.fixture(scope="session", autouse=True)
def no_leaked_shm():
    """After the whole suite, no hetccl shared-memory segment may be left in /dev/shm. Under
    pytest-xdist (the GPU box runs the suite on 4 workers) a worker's session can end while
    other workers' tests hold live segments, so a worker waits (bounded) for segments to go
    before it counts one as leaked; .ci/run checks /dev/shm once the whole run is over."""
    before = _hetccl_shm()
    yield
    import time

    deadline = time.monotonic() + (120 if os.environ.get("PYTEST_XDIST_WORKER") else 0)
    leaked = _hetccl_shm() - before
    while leaked and time.monotonic() < deadline:
        time.sleep(1)
        leaked = _hetccl_shm() - before
    assert not leaked, f"leaked shared-memory segments: {sorted(leaked)}"


def compiler(language: str, purpose: str) -> str:
    """The C ("c") or C++ ("c++") compiler the tests build their helper programs with. Without
    one the test fails (the build of hetccl needs one too), naming `purpose`."""
    names = ("cc", "gcc") if language == "c" else ("g++", "c++")
    path = next((p for p in map(shutil.which, names) if p), None)
    if not path:
        pytest.fail(f"no {language.upper()} compiler to build {purpose} (the build of hetccl needs one too)")
    return path
