"""Throwaway writes (-o throwaway, QEMU's -snapshot), through real mounts.

The image is opened read-only and every write goes to a temporary qcow2
overlay, an unnamed file (O_TMPFILE) in $TMPDIR, dropped at unmount:
  * fio writes and verifies through the view, fsync works, a punched hole reads
    zeros where the image has data, the rest of the image reads through;
  * while mounted, the image is held as QEMU's -snapshot holds it (read
    permissions only): `qemu-img info` (no -U) works, `qemu-io` writes are
    refused with QEMU's lock error, exactly as while `qemu-io -s` (QEMU's own
    -snapshot) holds it;
  * the overlay is an open file without a name in $TMPDIR: the directory stays
    empty while mounted, after unmount and after a kill -9 of the daemon;
  * the image file's sha256 never changes.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from qcowfs_testlib import helpers

MiB = 1 << 20
SIZE = 16 * MiB
LOCK_ERROR = r'Failed to get "write" lock'


def make_image(workdir: Path, fmt: str) -> Path:
    """SIZE bytes, 0x5a in the first 4 MiB, unallocated after."""
    img = workdir / f"disk.{fmt}"
    helpers.qemu_img("create", "-q", "-f", fmt, img, str(SIZE))
    helpers.qemu_io(img, "write -q -P 0x5a 0 4M", fmt=fmt)
    return img


def overlay_files(pid: int, tmpdir: Path) -> list[str]:
    """The files without a name in tmpdir that process pid holds open."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(f"{tmpdir}/") and target.endswith(" (deleted)"):
            found.append(target)
    return found


def throwaway_tmpdir(workdir: Path, monkeypatch) -> Path:
    """A fresh $TMPDIR for the daemon (it inherits the test's environment)."""
    tmpdir = workdir / "tmp"
    tmpdir.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    return tmpdir


def assert_held_read_only(img: Path, fmt: str) -> None:
    """QEMU's -snapshot takes read permissions only: readers get in, writers do not."""
    info = helpers.run(["qemu-img", "info", "-f", fmt, img], check=False, timeout=60)
    assert info.returncode == 0, f"qemu-img info refused by a throwaway mount:\n{info.stderr.decode()}"
    write = helpers.run(["qemu-io", "-f", fmt, "-c", "write -P 1 0 4k", img], check=False, timeout=60)
    text = (write.stdout + write.stderr).decode(errors="replace")
    assert re.search(LOCK_ERROR, text), f"qemu-io could write to an image a throwaway mount holds:\n{text}"


@contextlib.contextmanager
def qemu_snapshot_holding(img: Path, fmt: str):
    """QEMU's own -snapshot (qemu-io -s) holding img until the block ends."""
    proc = subprocess.Popen(["qemu-io", "-s", "-f", fmt, str(img)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        helpers.QemuIoSession(proc).read_to_prompt()
        yield
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=helpers.EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            helpers.kill_group(proc.pid)
            proc.wait()


@pytest.mark.parametrize("fmt", ["qcow2", "vmdk"])
def test_writes_stay_in_the_overlay(workdir, qcowfs, monkeypatch, fmt):
    img = make_image(workdir, fmt)
    before = helpers.sha256_file(img)
    with qemu_snapshot_holding(img, fmt):  # the referee: what QEMU's -snapshot lets in
        assert_held_read_only(img, fmt)
    tmpdir = throwaway_tmpdir(workdir, monkeypatch)
    with helpers.mounted(img, workdir / "view", ["throwaway"]) as m:
        assert os.stat(m.path).st_size == SIZE
        assert len(overlay_files(m.proc.pid, tmpdir)) == 1, os.listdir(f"/proc/{m.proc.pid}/fd")
        # Over the image's data and past it; fio reads every block back and
        # fsyncs at the end (a failed fsync fails fio).
        helpers.run(["fio", "--name=throwaway", f"--filename={m.path}", "--rw=randwrite", "--bs=64k",
                     "--offset=2M", "--size=8M", "--ioengine=psync", "--verify=crc32c", "--do_verify=1",
                     "--fsync_on_close=1", "--randseed=7", "--output-format=terse"], timeout=120)
        helpers.run(["fallocate", "--punch-hole", "--offset", "0", "--length", str(MiB), m.path])
        with open(m.path, "rb") as f:
            view = f.read()
            os.fsync(f.fileno())
        assert len(view) == SIZE
        assert view[:MiB] == bytes(MiB), "a punched hole shows the image's bytes"
        assert view[MiB:2 * MiB] == b"\x5a" * MiB, "the image's data does not read through"
        assert view[10 * MiB:] == bytes(6 * MiB)
        assert_held_read_only(img, fmt)
        assert os.listdir(tmpdir) == []
    assert helpers.sha256_file(img) == before, "a throwaway mount changed the image"
    assert os.listdir(tmpdir) == []


def test_kill_leaves_no_file_and_the_image_unchanged(workdir, qcowfs, monkeypatch):
    img = make_image(workdir, "raw")
    before = helpers.sha256_file(img)
    tmpdir = throwaway_tmpdir(workdir, monkeypatch)
    with helpers.mounted(img, workdir / "view", ["throwaway"], expect_exit=None) as m:
        with open(m.path, "r+b") as f:
            f.write(b"\xa5" * (2 * MiB))
            f.flush()
            os.fsync(f.fileno())
        with open(m.path, "rb") as f:
            assert f.read(2 * MiB) == b"\xa5" * (2 * MiB)
        assert len(overlay_files(m.proc.pid, tmpdir)) == 1
        m.proc.send_signal(signal.SIGKILL)
        assert m.proc.wait(timeout=helpers.EXIT_TIMEOUT_S) == -signal.SIGKILL
    assert os.listdir(tmpdir) == []
    assert helpers.sha256_file(img) == before, "a killed throwaway mount changed the image"
