"""FUSE over io_uring (Linux 6.14+): requests reach the daemon as completions on
its event loops' rings instead of read()s of /dev/fuse, when the kernel allows it
(module parameter fuse.enable_uring) and -o fuse_uring is auto (the default) or on.

Each test sets the parameter itself (root only, as CI runs) and restores it.
The daemon's debug log says how many requests each queue thread served through
io_uring, which is how these tests see which path carried the I/O."""

from __future__ import annotations

import os
import random
import re
import subprocess
from pathlib import Path

import pytest

from qcowfs_testlib import helpers

MiB = 1 << 20
PARAM = Path("/sys/module/fuse/parameters/enable_uring")


@pytest.fixture
def uring_param():
    """Yields a setter for fuse.enable_uring; restores the old value afterwards."""
    assert PARAM.exists(), f"{PARAM} missing: this kernel has no FUSE over io_uring (needs 6.14+)"
    assert os.geteuid() == 0, "setting fuse.enable_uring needs root"
    old = PARAM.read_text().strip()

    def set_param(on: bool) -> None:
        PARAM.write_text("Y" if on else "N")
        assert PARAM.read_text().strip() == ("Y" if on else "N")

    yield set_param
    PARAM.write_text(old)


def make_raw(path: Path, size: int, seed: int) -> Path:
    with open(path, "wb") as f:
        f.write(random.Random(seed).randbytes(size))
    return path


def ring_requests(log: str) -> int:
    """Requests served through io_uring, summed over the queue threads' debug lines."""
    counts = re.findall(r"queue thread served (\d+) requests through io_uring", log)
    return sum(int(c) for c in counts)


FIO_REQUESTS = 2 * 2 * (8 * MiB // 4096)  # two jobs, each writing then verifying 8 MiB in 4 KiB


def fio_verify(path: Path, bs: str = "4k-4k") -> None:
    """Random writes at QD32 from two jobs (8 MiB each, apart), then a verify pass."""
    helpers.run(["fio", "--name=uring", f"--filename={path}", "--rw=randwrite", f"--bsrange={bs}",
                 "--ioengine=io_uring", "--direct=1", "--iodepth=32", "--numjobs=2", "--size=8M",
                 "--offset_increment=32M", "--verify=crc32c", "--do_verify=1", "--verify_fatal=1",
                 "--group_reporting"])


def test_requests_travel_through_the_ring(workdir: Path, uring_param) -> None:
    uring_param(True)
    image = make_raw(workdir / "disk.img", 64 * MiB, seed=1)
    target = workdir / "view"
    with helpers.mounted(image, target, ["rw", "fuse_uring=on", "queues=2"], extra_args=["-d"]) as m:
        fio_verify(m.path)
        fio_verify(m.path, "4k-1m")  # payloads up to max_write in the ring entries
        with open(m.path, "rb") as f:
            through_mount = f.read()
    assert through_mount == image.read_bytes(), "the mounted view and the image differ"
    log = m.final_log
    served = ring_requests(log)
    # Every fio request goes through the ring; only INIT (and forgets) use /dev/fuse.
    assert served >= FIO_REQUESTS, f"only {served} requests went through io_uring:\n{log[-2000:]}"


def test_ring_requests_without_debug(workdir: Path, uring_param) -> None:
    """Without -d, READ and WRITE from the ring are decoded and answered by
    qcowfs itself (Filesystem::serve_direct), not libfuse: the same data."""
    uring_param(True)
    image = make_raw(workdir / "disk.img", 64 * MiB, seed=5)
    target = workdir / "view"
    with helpers.mounted(image, target, ["rw", "fuse_uring=on", "queues=2"]) as m:  # on: the ring or no mount
        fio_verify(m.path)
        fio_verify(m.path, "4k-1m")
        with open(m.path, "rb") as f:
            through_mount = f.read()
    assert through_mount == image.read_bytes(), "the mounted view and the image differ"


def test_more_queue_threads_than_cpus(workdir: Path, uring_param) -> None:
    """Queue threads without a kernel queue of their own still serve /dev/fuse."""
    uring_param(True)
    image = make_raw(workdir / "disk.img", 64 * MiB, seed=2)
    target = workdir / "view"
    queues = os.cpu_count() + 2
    with helpers.mounted(image, target, ["rw", f"queues={queues}"]) as m:
        fio_verify(m.path)
        assert m.path.read_bytes() == image.read_bytes()


def test_auto_falls_back_to_dev_fuse_when_the_kernel_refuses(workdir: Path, uring_param) -> None:
    uring_param(False)
    image = make_raw(workdir / "disk.img", 64 * MiB, seed=3)
    target = workdir / "view"
    with helpers.mounted(image, target, ["rw"], extra_args=["-d"]) as m:
        fio_verify(m.path)
        assert m.path.read_bytes() == image.read_bytes()
    log = m.final_log
    assert "serving through /dev/fuse" in log, log[-2000:]
    assert ring_requests(log) == 0


def test_off_never_uses_the_ring(workdir: Path, uring_param) -> None:
    uring_param(True)
    image = make_raw(workdir / "disk.img", 64 * MiB, seed=4)
    target = workdir / "view"
    with helpers.mounted(image, target, ["rw", "fuse_uring=off"], extra_args=["-d"]) as m:
        fio_verify(m.path)
        assert m.path.read_bytes() == image.read_bytes()
    log = m.final_log
    assert "through io_uring" not in log, log[-2000:]


def test_on_fails_the_mount_when_the_kernel_refuses(workdir: Path, uring_param) -> None:
    uring_param(False)
    image = make_raw(workdir / "disk.img", 8 * MiB, seed=5)
    target = workdir / "view"
    target.touch()
    proc = subprocess.run([helpers.qcowfs_bin(), "-f", "-o", "fuse_uring=on", str(image), str(target)],
                          capture_output=True, text=True, timeout=20)
    assert proc.returncode != 0
    assert "fuse_uring=on" in proc.stderr and "not supported" in proc.stderr.lower(), proc.stderr
    assert not helpers.is_fuse_mounted(target)


def test_switching_the_parameter_off_keeps_a_live_ring_working(workdir: Path, uring_param) -> None:
    """The INIT reply claims io_uring for the connection, so turning
    fuse.enable_uring off later must not break requests already using it."""
    uring_param(True)
    image = make_raw(workdir / "disk.img", 64 * MiB, seed=6)
    target = workdir / "view"
    with helpers.mounted(image, target, ["rw", "fuse_uring=on"], extra_args=["-d"]) as m:
        with open(m.path, "rb") as f:
            f.read(MiB)  # the ring is up
        uring_param(False)
        fio_verify(m.path)
        assert m.path.read_bytes() == image.read_bytes()
    log = m.final_log
    assert ring_requests(log) >= FIO_REQUESTS, log[-2000:]
