import glob
import os

import pytest


def _hetccl_shm():
    return set(glob.glob("/dev/shm/hetccl*"))


@pytest.fixture(scope="session", autouse=True)
def no_leaked_shm():
    """After the whole suite, no hetccl shared-memory segment may be left in /dev/shm."""
    before = _hetccl_shm()
    yield
    leaked = _hetccl_shm() - before
    assert not leaked, f"leaked shared-memory segments: {sorted(leaked)}"
