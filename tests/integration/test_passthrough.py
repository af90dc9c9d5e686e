"""FUSE passthrough (Linux 6.9+, root): on a read-only mount of a raw image
over a regular file, opens are served by the kernel from the image file
itself, without a request to the daemon. Everything else (read-write mounts,
qcow2, passthrough=off) goes through the daemon as before.

The tests tell the two paths apart by stopping the daemon (SIGSTOP): a read on
a passthrough open still completes, a read the daemon has to answer waits
until the daemon runs again. /var/tmp (the workdir) is a disk filesystem with
512-byte O_DIRECT alignment, so its images qualify."""

from __future__ import annotations

import errno
import mmap
import os
import platform
import random
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from qcowfs_testlib import helpers

MiB = 1 << 20
SIZE = 8 * MiB
BLOCKED_S = 0.5  # how long a read the daemon must answer is seen waiting


@pytest.fixture(autouse=True)
def needs_passthrough() -> None:
    release = tuple(int(x) for x in platform.release().split(".")[:2])
    assert release >= (6, 9), f"kernel {platform.release()} has no FUSE passthrough (needs 6.9+)"
    assert os.geteuid() == 0, "FUSE passthrough needs CAP_SYS_ADMIN"


def make_raw(path: Path, seed: int) -> tuple[Path, bytes]:
    data = random.Random(seed).randbytes(SIZE)
    path.write_bytes(data)
    return path, data


def thread_states(pid: int) -> list[str]:
    """The scheduler state letter of every thread of pid (R, S, D, T, ...)."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except FileNotFoundError:
            continue  # the thread ended meanwhile
        states.append(stat[stat.rindex(")") + 2])
    return states


@contextmanager
def daemon_stopped(m: helpers.Mount):
    """The daemon with every one of its threads stopped. kill() only queues
    SIGSTOP: each thread stops when it next notices the signal, so on a busy
    machine an event-loop thread may still answer a request for a moment after
    kill() returned. Wait until all of them are stopped."""
    os.kill(m.proc.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 10
        while not all(s == "T" for s in thread_states(m.proc.pid)):
            assert time.monotonic() < deadline, f"daemon threads not stopped: {thread_states(m.proc.pid)}"
            time.sleep(0.01)
        yield
    finally:
        os.kill(m.proc.pid, signal.SIGCONT)


def read_at(fd: int, off: int, length: int) -> bytes:
    buf = mmap.mmap(-1, length)  # page aligned, for O_DIRECT opens
    n = os.preadv(fd, [buf], off)
    return bytes(buf[:n])


def read_while_stopped(m: helpers.Mount, fd: int, off: int, length: int) -> tuple[bool, bytes]:
    """Reads with the daemon stopped: (whether the read finished without it, the bytes)."""
    result: list[bytes] = []
    reader = threading.Thread(target=lambda: result.append(read_at(fd, off, length)))
    with daemon_stopped(m):
        reader.start()
        reader.join(BLOCKED_S)
        without_daemon = not reader.is_alive()
    reader.join(10)
    assert not reader.is_alive(), "the read never finished after the daemon continued"
    return without_daemon, result[0]


CASES = [
    # (image format, mount options, open flags, served by the kernel)
    ("raw", ["cache=none"], os.O_DIRECT, True),
    ("raw", ["cache=none"], 0, True),
    ("raw", ["cache=writeback"], 0, True),
    ("raw", ["cache=writeback"], os.O_DIRECT, True),
    ("raw", ["rw", "cache=none"], os.O_DIRECT, False),  # writes must reach the daemon
    ("raw", ["cache=none", "passthrough=off"], os.O_DIRECT, False),
    ("qcow2", ["cache=none"], os.O_DIRECT, False),  # guest offsets are not host offsets
]


@pytest.mark.parametrize("fmt,opts,flags,kernel_serves", CASES,
                         ids=[f"{c[0]}-{','.join(c[1])}-{'direct' if c[2] else 'buffered'}" for c in CASES])
def test_which_reads_pass_through(workdir: Path, fmt: str, opts: list[str], flags: int,
                                  kernel_serves: bool) -> None:
    image, data = make_raw(workdir / "disk.raw", 11)
    if fmt == "qcow2":
        helpers.qemu_img("convert", "-f", "raw", "-O", "qcow2", str(image), str(workdir / "disk.qcow2"))
        image = workdir / "disk.qcow2"
    with helpers.mounted(image, workdir / "view", opts) as m:
        fd = os.open(m.path, os.O_RDONLY | flags)
        try:
            without_daemon, got = read_while_stopped(m, fd, 3 * MiB, 256 * 1024)
            assert got == data[3 * MiB:3 * MiB + 256 * 1024]
            assert without_daemon == kernel_serves
        finally:
            os.close(fd)


def test_passed_through_opens_keep_the_views_rules(workdir: Path) -> None:
    """O_DIRECT and buffered readers side by side, short reads at the end,
    writes refused, the image untouched."""
    image, data = make_raw(workdir / "disk.raw", 12)
    with helpers.mounted(image, workdir / "view", ["cache=none"]) as m:
        direct = os.open(m.path, os.O_RDONLY | os.O_DIRECT)
        buffered = os.open(m.path, os.O_RDONLY)
        try:
            for fd in (direct, buffered):
                assert read_while_stopped(m, fd, 0, 4096) == (True, data[:4096])
                assert read_at(fd, SIZE - 4096, 65536) == data[-4096:]
                assert read_at(fd, SIZE, 4096) == b""
            assert os.fstat(direct).st_size == SIZE
            with pytest.raises(OSError) as e:
                os.open(m.path, os.O_RDWR)
            assert e.value.errno in (errno.EROFS, errno.EACCES)
        finally:
            os.close(buffered)
            os.close(direct)
    assert image.read_bytes() == data


def test_read_only_mount_of_the_image_itself(workdir: Path) -> None:
    """Mounted over the image file: the kernel reads the file the view hides."""
    image, data = make_raw(workdir / "disk.img", 14)
    with helpers.mounted(image, image, ["format=raw"]) as m:
        fd = os.open(m.path, os.O_RDONLY)
        try:
            without_daemon, got = read_while_stopped(m, fd, SIZE - 65536, 131072)
            assert without_daemon
            assert got == data[-65536:]  # short at the end, as the daemon would answer
        finally:
            os.close(fd)
    assert image.read_bytes() == data


def test_hosts_with_4k_direct_alignment_keep_reads_on_the_daemon(workdir: Path) -> None:
    """Passed through, a 512-byte O_DIRECT read would meet the host's 4096-byte
    rule (EINVAL); through the daemon it works, so such hosts do not pass through."""
    with helpers.host_fs_on_4k_device(workdir) as hostfs:
        image, data = make_raw(hostfs / "disk.raw", 15)
        with helpers.mounted(image, workdir / "view", ["cache=none"]) as m:
            fd = os.open(m.path, os.O_RDONLY | os.O_DIRECT)
            try:
                without_daemon, got = read_while_stopped(m, fd, 512 * 3, 512)
                assert got == data[1536:2048]
                assert not without_daemon
            finally:
                os.close(fd)
