"""Raw images through a real qcowfs mount: file and directory mode, read and
write paths (buffered and O_DIRECT dd), the fixed-size-disk rules (short reads
at EOF, ENOSPC at it and short writes across it, truncate moving the limit),
fallocate, SEEK_DATA / SEEK_HOLE, attributes, read-only mounts, daemon mode and request sizes."""

from __future__ import annotations

import errno
import mmap
import os
import random
import stat
import subprocess
import time
from pathlib import Path

import pytest

from qcowfs_testlib import helpers

MiB = 1 << 20


def make_raw(path: Path, size: int, *, seed: int | None = None) -> Path:
    """A sparse raw image; with a seed, its first MiB is random and the rest sparse."""
    with open(path, "wb") as f:
        f.truncate(size)
        if seed is not None:
            f.write(random.Random(seed).randbytes(MiB))
    return path


def dd(*args: str) -> None:
    helpers.run(["dd", "status=none", *args])


def aligned_buffer(data: bytes) -> mmap.mmap:
    buf = mmap.mmap(-1, len(data))
    buf.write(data)
    return buf


def test_rw_over_file_matches_image(workdir: Path) -> None:
    image = make_raw(workdir / "disk.img", 16 * MiB, seed=1)
    target = workdir / "view"
    payload = random.Random(2).randbytes(3 * MiB + 123)
    with helpers.mounted(image, target, ["rw"]) as m:
        assert m.path == target
        assert os.path.getsize(target) == 16 * MiB
        with open(target, "r+b", buffering=0) as f:
            os.pwrite(f.fileno(), payload, 5 * MiB + 7)
            os.fsync(f.fileno())
            assert os.pread(f.fileno(), len(payload), 5 * MiB + 7) == payload
        assert helpers.files_equal(target, image)
    with open(image, "rb") as f:
        f.seek(5 * MiB + 7)
        assert f.read(len(payload)) == payload


def test_rw_into_directory(workdir: Path) -> None:
    image = make_raw(workdir / "vm.qcow2.img", 8 * MiB, seed=3)  # probed as raw
    mnt = workdir / "mnt"
    mnt.mkdir()
    with helpers.mounted(image, mnt, ["rw", "format=raw"]) as m:
        # The disk view and partitions/ (always there: a disk may be partitioned through the
        # mount); raw images have no snapshots/.
        assert sorted(os.listdir(mnt)) == ["partitions", "vm.qcow2.raw"]
        assert m.path == mnt / "vm.qcow2.raw"
        st = os.stat(m.path)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o644
        assert st.st_uid == os.getuid()
        assert stat.S_ISDIR(os.stat(mnt).st_mode)
        with pytest.raises(FileNotFoundError):
            os.stat(mnt / "nothing.raw")
        dd(f"if=/dev/urandom", f"of={m.path}", "bs=64k", "count=16", "seek=3", "conv=notrunc,fsync")
        assert helpers.files_equal(m.path, image)
        vfs = os.statvfs(mnt)
        assert vfs.f_blocks * vfs.f_frsize == 8 * MiB


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_dd_roundtrip(workdir: Path, direct: bool) -> None:
    image = make_raw(workdir / "disk.raw", 32 * MiB)
    src = workdir / "src.bin"
    src.write_bytes(random.Random(4).randbytes(12 * MiB))
    out = workdir / "out.bin"
    oflag = ["oflag=direct"] if direct else []
    iflag = ["iflag=direct"] if direct else []
    with helpers.mounted(image, workdir / "view", ["rw"]) as m:
        dd(f"if={src}", f"of={m.path}", "bs=1M", "seek=2", "conv=notrunc,fsync", *oflag)
        dd(f"if={m.path}", f"of={out}", "bs=1M", "skip=2", "count=12", *iflag)
        assert helpers.files_equal(out, src)
        # Unaligned sizes and offsets through the page-cache-less view.
        # Unaligned sizes and offsets through the page-cache-less view.
        dd(f"if={src}", f"of={m.path}", "bs=777", "count=100", "seek=5", "conv=notrunc")
    data = src.read_bytes()
    with open(image, "rb") as f:
        assert os.pread(f.fileno(), 77700, 5 * 777) == data[:77700]
        assert os.pread(f.fileno(), 12 * MiB, 2 * MiB) == data


def test_o_direct_open_with_aligned_io(workdir: Path) -> None:
    image = make_raw(workdir / "disk.raw", 4 * MiB)
    data = random.Random(5).randbytes(MiB)
    with helpers.mounted(image, workdir / "view", ["rw"]) as m:
        fd = os.open(m.path, os.O_RDWR | os.O_DIRECT)
        try:
            assert os.pwritev(fd, [aligned_buffer(data)], MiB) == MiB
            back = mmap.mmap(-1, MiB)
            assert os.preadv(fd, [back], MiB) == MiB
            assert bytes(back) == data
        finally:
            os.close(fd)


def test_fixed_size_rules(workdir: Path) -> None:
    size = 4 * MiB
    image = make_raw(workdir / "disk.raw", size)
    with helpers.mounted(image, workdir / "view", ["rw"]) as m:
        fd = os.open(m.path, os.O_RDWR)
        try:
            assert os.pread(fd, 4096, size - 100) == b"\0" * 100  # short at the end
            assert os.pread(fd, 4096, size) == b""  # EOF
            assert os.pread(fd, 4096, size + MiB) == b""
            # As on a block device: a write at the end is ENOSPC, one across it is short.
            with pytest.raises(OSError) as e:
                os.pwrite(fd, b"x" * 10, size)
            assert e.value.errno == errno.ENOSPC
            assert os.pwrite(fd, b"y" * 8192, size - 4096) == 4096
            assert os.pread(fd, 8192, size - 4096) == b"y" * 4096
            assert os.fstat(fd).st_size == size
            # truncate moves the limit: the new size applies.
            os.ftruncate(fd, size + MiB)
            assert os.fstat(fd).st_size == size + MiB
            assert os.pwrite(fd, b"z" * 10, size) == 10
            assert os.pread(fd, 10, size) == b"z" * 10
            # Shrinking over data is refused and changes nothing.
            with pytest.raises(OSError) as e:
                os.ftruncate(fd, size)
            assert e.value.errno == errno.EINVAL
            assert os.fstat(fd).st_size == size + MiB
            assert os.pread(fd, 10, size) == b"z" * 10
        finally:
            os.close(fd)
    assert os.path.getsize(image) == size + MiB


def test_fallocate_and_seek_holes(workdir: Path) -> None:
    size = 8 * MiB
    image = make_raw(workdir / "disk.raw", size)
    with helpers.mounted(image, workdir / "view", ["rw", "discard=unmap"]) as m:
        fd = os.open(m.path, os.O_RDWR)
        try:
            os.pwrite(fd, b"\xaa" * (2 * MiB), MiB)
            os.fsync(fd)
            assert helpers.data_extents(m.path) == [(MiB, 3 * MiB)]
            # PUNCH_HOLE|KEEP_SIZE: reads back as zeros and frees the range.
            fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, MiB, MiB)
            assert os.pread(fd, MiB, MiB) == b"\0" * MiB
            assert helpers.data_extents(m.path) == [(2 * MiB, 3 * MiB)]
            assert os.lseek(fd, 0, os.SEEK_DATA) == 2 * MiB
            assert os.lseek(fd, 2 * MiB, os.SEEK_HOLE) == 3 * MiB
            with pytest.raises(OSError) as e:
                os.lseek(fd, size, os.SEEK_DATA)
            assert e.value.errno == errno.ENXIO
            with pytest.raises(OSError) as e:
                os.lseek(fd, 4 * MiB, os.SEEK_DATA)  # only holes after 3 MiB
            assert e.value.errno == errno.ENXIO
            # ZERO_RANGE zeroes without growing the disk; growing is EFBIG.
            fallocate(fd, FALLOC_FL_ZERO_RANGE, 2 * MiB + 100, 1000)
            assert os.pread(fd, 1200, 2 * MiB) == b"\xaa" * 100 + b"\0" * 1000 + b"\xaa" * 100
            with pytest.raises(OSError) as e:
                fallocate(fd, FALLOC_FL_ZERO_RANGE, size - 10, 20)
            assert e.value.errno == errno.EFBIG
            fallocate(fd, 0, 0, size)  # mode 0 inside the disk: nothing to do
            with pytest.raises(OSError) as e:
                fallocate(fd, FALLOC_FL_COLLAPSE_RANGE, 0, MiB)
            assert e.value.errno == errno.EOPNOTSUPP
            assert os.fstat(fd).st_size == size
        finally:
            os.close(fd)
    with open(image, "rb") as f:
        assert os.lseek(f.fileno(), 0, os.SEEK_DATA) >= 2 * MiB  # host space really freed


FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_COLLAPSE_RANGE = 0x08
FALLOC_FL_ZERO_RANGE = 0x10


def fallocate(fd: int, mode: int, off: int, length: int) -> None:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if libc.fallocate(fd, mode, off, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def test_read_only_mount_rejects_writes(workdir: Path) -> None:
    image = make_raw(workdir / "disk.raw", 4 * MiB, seed=6)
    before = helpers.sha256_file(image)
    with helpers.mounted(image, workdir / "view") as m:  # read-only is the default
        st = os.stat(m.path)
        assert stat.S_IMODE(st.st_mode) == 0o444
        with open(m.path, "rb") as f:
            assert f.read(MiB) == image.read_bytes()[:MiB]
        for flags in (os.O_WRONLY, os.O_RDWR):
            with pytest.raises(OSError) as e:
                os.open(m.path, flags)
            assert e.value.errno in (errno.EROFS, errno.EACCES)
        with pytest.raises(OSError) as e:
            os.truncate(m.path, MiB)
        assert e.value.errno in (errno.EROFS, errno.EACCES)
        proc = helpers.run(["dd", "if=/dev/zero", f"of={m.path}", "bs=4k", "count=1", "conv=notrunc"],
                           check=False)
        assert proc.returncode != 0
    assert helpers.sha256_file(image) == before


def test_large_writes_arrive_whole(workdir: Path) -> None:
    """max_write is really 1 MiB: a 1 MiB O_DIRECT write is one WRITE request."""
    image = make_raw(workdir / "disk.raw", 8 * MiB)
    with helpers.mounted(image, workdir / "view", ["rw"], extra_args=["-d"]) as m:
        dd("if=/dev/urandom", f"of={m.path}", "bs=1M", "count=4", "oflag=direct", "conv=notrunc")
        log = m.stderr()
    header = 80  # fuse_in_header + fuse_write_in
    sizes = [int(line.split("insize: ")[1].split(",")[0]) for line in log.splitlines()
             if "opcode: WRITE" in line]
    assert sizes.count(MiB + header) >= 4, f"WRITE request sizes seen: {sizes}"


def test_daemon_mode_mounts_and_exits(workdir: Path) -> None:
    image = make_raw(workdir / "disk.raw", 2 * MiB, seed=7)
    with helpers.mounted(image, workdir / "view", ["rw"], foreground=False) as m:
        assert m.daemon_pids, "no daemon process found"
        assert helpers.files_equal(m.path, image)
        os.truncate(m.path, 3 * MiB)
    assert os.path.getsize(image) == 3 * MiB


def test_daemon_mode_reports_startup_errors(workdir: Path, qcowfs: str) -> None:
    target = workdir / "view"
    target.touch()
    image = make_raw(workdir / "notqcow2.img", MiB, seed=8)
    # The image opens in the forked daemon: its error must reach the caller.
    proc = subprocess.run([qcowfs, "-o", "format=qcow2", str(image), str(target)], capture_output=True,
                          timeout=10)
    assert proc.returncode == 1
    assert b"notqcow2.img" in proc.stderr or b"qcow2" in proc.stderr, proc.stderr
    assert not helpers.is_fuse_mounted(target)


def test_mount_over_the_image_itself(workdir: Path) -> None:
    """As with qemu-storage-daemon: the raw view replaces the image file it shows."""
    image = make_raw(workdir / "disk.raw", 2 * MiB, seed=9)
    original = image.read_bytes()
    with helpers.mounted(image, image, ["rw", "allow_other"]) as m:
        fields = [l.split() for l in Path("/proc/self/mounts").read_text().splitlines()]
        opts = [f[3] for f in fields if f[1] == str(image) and f[2] == "fuse.qcowfs"]
        assert opts and "allow_other" in opts[0].split(","), opts
        with open(image, "r+b", buffering=0) as f:
            assert f.read(MiB) == original[:MiB]
            os.pwrite(f.fileno(), b"through the view", 4096)
    data = image.read_bytes()
    assert data[4096:4112] == b"through the view"
    assert data[:4096] == original[:4096]


def daemon_pids_for(image: Path) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv and argv[0].endswith(b"qcowfs") and str(image).encode() in argv:
                pids.append(int(entry))
    return pids


def test_mount_helper_invocation(workdir: Path, qcowfs: str) -> None:
    """What `mount -t fuse.qcowfs` and fstab run: mount.fuse3 IMAGE DIR -t qcowfs -o OPTS."""
    image = make_raw(workdir / "disk.raw", 2 * MiB, seed=10)
    bindir = workdir / "bin"
    bindir.mkdir()
    (bindir / "qcowfs").symlink_to(os.path.abspath(qcowfs))
    mnt = workdir / "mnt"
    mnt.mkdir()
    env = dict(os.environ, PATH=f"{bindir}:{os.environ.get('PATH', '/usr/bin:/bin')}")
    proc = subprocess.run(["mount.fuse3", str(image), str(mnt), "-t", "qcowfs", "-o",
                           "rw,noauto,nofail,x-systemd.automount,cache=writeback"],
                          env=env, capture_output=True, timeout=20)
    try:
        assert proc.returncode == 0, proc.stderr.decode()
        assert helpers.is_fuse_mounted(mnt)
        view = mnt / "disk.raw"
        assert view.read_bytes() == image.read_bytes()
        with open(view, "r+b", buffering=0) as f:
            os.pwrite(f.fileno(), b"via mount.fuse3", 0)
        pids = daemon_pids_for(image)
        assert pids, "no qcowfs daemon found"
    finally:
        helpers.unmount(mnt)
    deadline = time.monotonic() + helpers.EXIT_TIMEOUT_S
    while any(helpers.pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(helpers.pid_alive(p) for p in pids), "the daemon outlived its mount"
    assert image.read_bytes().startswith(b"via mount.fuse3")
