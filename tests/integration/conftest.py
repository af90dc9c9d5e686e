"""Pytest fixtures shared by every integration test file.

Fixtures:
  workdir     a fresh directory under /var/tmp (a real disk filesystem, not
              tmpfs, so O_DIRECT and SEEK_HOLE behave as on a user's disk);
              any FUSE mount left below it is unmounted and the directory
              removed after the test, pass or fail.
  qcowfs      path of the binary under test (fails the test if it is missing).

The helpers are the qcowfs_testlib package (tests/qcowfs_testlib/; tests/pytest.ini
puts tests/ on the module path): `from qcowfs_testlib import helpers`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from qcowfs_testlib import helpers

WORK_ROOT = os.environ.get("QCOWFS_TEST_TMP", "/var/tmp")


@pytest.fixture
def workdir(request) -> Path:
    path = Path(tempfile.mkdtemp(prefix=f"qcowfs-{safe_name(request.node.name)}-", dir=WORK_ROOT))
    try:
        yield path
    finally:
        leftover = helpers.cleanup_mounts_under(path)
        shutil.rmtree(path, ignore_errors=True)
        assert not leftover, f"test left FUSE mounts behind: {leftover}"


@pytest.fixture(scope="session")
def qcowfs() -> str:
    return helpers.qcowfs_bin()


def safe_name(name: str) -> str:
    keep = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return keep[:60]
