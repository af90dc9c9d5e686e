"""Raw images under real block-level users: fio write-then-verify (O_DIRECT,
io_uring, QD16) across a remount, a loop device on the mounted file, and a
host file on a 4096-byte-sector device with cache=none."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from qcowfs_testlib import helpers

MiB = 1 << 20


def make_raw(path: Path, size: int) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def fio(path: Path, *args: str) -> str:
    return helpers.run(["fio", "--name=job", f"--filename={path}", "--ioengine=io_uring", "--direct=1",
                        "--iodepth=16", "--size=48M", "--bs=64k", "--verify=crc32c", "--verify_fatal=1",
                        "--output-format=terse", *args]).stdout.decode()


@pytest.mark.parametrize("aio", ["io_uring", "threads"])
def test_fio_write_then_verify_across_remount(workdir: Path, aio: str) -> None:
    image = make_raw(workdir / "disk.raw", 64 * MiB)
    target = workdir / "view"
    with helpers.mounted(image, target, ["rw", f"aio={aio}"]) as m:
        fio(m.path, "--rw=randwrite", "--do_verify=1")
    with helpers.mounted(image, target, ["rw", f"aio={aio}"]) as m:  # fio opens read-write even to verify
        fio(m.path, "--rw=randwrite", "--verify_only")
    # And the image itself holds what fio verified.
    helpers.run(["fio", "--name=job", f"--filename={image}", "--ioengine=psync", "--size=48M", "--bs=64k",
                 "--rw=randwrite", "--verify=crc32c", "--verify_fatal=1", "--verify_only",
                 "--output-format=terse"])


def test_loop_device_on_the_mounted_file(workdir: Path) -> None:
    image = make_raw(workdir / "disk.raw", 32 * MiB)
    data = random.Random(11).randbytes(4 * MiB)
    with helpers.mounted(image, workdir / "view", ["rw"]) as m:
        with helpers.loop_device(m.path) as dev:
            assert int(helpers.run(["blockdev", "--getsize64", dev]).stdout) == 32 * MiB
            fd = os.open(dev, os.O_RDWR)
            try:
                os.pwrite(fd, data, 3 * MiB)
                os.fsync(fd)
            finally:
                os.close(fd)
            with open(image, "rb") as f:
                assert os.pread(f.fileno(), len(data), 3 * MiB) == data
            # Reads through the loop device see what the image holds.
            with open(image, "r+b") as f:
                os.pwrite(f.fileno(), b"\x5a" * 8192, 20 * MiB)
            helpers.run(["blockdev", "--flushbufs", dev])
            with open(dev, "rb") as f:
                assert os.pread(f.fileno(), 8192, 20 * MiB) == b"\x5a" * 8192
                assert os.pread(f.fileno(), len(data), 3 * MiB) == data
        assert helpers.files_equal(m.path, image)


def test_cache_none_on_4k_sector_host(workdir: Path) -> None:
    with helpers.host_fs_on_4k_device(workdir) as hostfs:
        image = make_raw(hostfs / "disk.raw", 16 * MiB)
        rng = random.Random(12)
        writes = [(rng.randrange(0, 16 * MiB // 512 - 16) * 512, rng.randbytes(512 * rng.randrange(1, 9)))
                  for _ in range(64)]
        expect = bytearray(16 * MiB)
        with helpers.mounted(image, workdir / "view", ["rw", "cache=none"]) as m:
            fd = os.open(m.path, os.O_RDWR)
            try:
                for off, data in writes:  # 512-byte granular: read-modify-write on the host
                    assert os.pwrite(fd, data, off) == len(data)
                    expect[off:off + len(data)] = data
                os.fsync(fd)
                odd = os.pread(fd, 1000, 12345)
                assert odd == bytes(expect[12345:13345])
            finally:
                os.close(fd)
            assert "falling back" not in m.stderr()
        with open(image, "rb") as f:
            assert f.read() == bytes(expect)


def test_fio_mixed_sizes_many_jobs_verify(workdir: Path) -> None:
    """Small (copied) and large (zero-copy) write payloads from 4 jobs at QD16
    each, on 3 queue threads, all verified: request buffers must never be
    reused while a write still points into them."""
    image = make_raw(workdir / "disk.raw", 64 * MiB)
    with helpers.mounted(image, workdir / "view", ["rw", "queues=3"]) as m:
        helpers.run(["fio", "--name=mix", f"--filename={m.path}", "--ioengine=io_uring", "--direct=1",
                     "--iodepth=16", "--numjobs=4", "--size=12M", "--offset_increment=16M",
                     "--rw=randwrite", "--bsrange=4k-1m", "--bs_unaligned=0", "--verify=crc32c",
                     "--verify_fatal=1", "--do_verify=1", "--group_reporting", "--output-format=terse"])
