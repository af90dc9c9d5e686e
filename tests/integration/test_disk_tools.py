"""The raw view behaves like a disk for the tools people fill and inspect
disks with. Each tool runs against the view of a raw and a qcow2 image, fresh
(nothing stored) and with data, read-write, with cache=none and writeback.
Afterwards the image is checked with QEMU's tools: `qemu-img info` for the
virtual size, `qemu-img convert -O raw` for every byte (compared with a model
of what a block device of the same size would hold), `qemu-img check` for
qcow2. A tool either does what it does on a block device, or fails with a
clear errno and changes nothing.

The rules under test (README "The view is a disk"):
- O_TRUNC never truncates the view (dd without conv=notrunc, cp, cat >);
- a write crossing the end is short, one at the end is ENOSPC;
- shrinking is refused with EINVAL over data, and works over holes; but an
  ftruncate to 0 through an open is O_TRUNC again, and after it (or O_TRUNC)
  the sizes that open sets up to the disk's change nothing on the disk and
  read as zeros up to them once it closes: qemu-img convert without -n (its
  raw create) writes the source at the start and keeps the rest;
- growing works; punch and zero ranges read back as zeros;
- shared mmap works; sfdisk then mkfs on a new partition works at once."""

from __future__ import annotations

import errno
import functools
import mmap
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from qcowfs_testlib import helpers

WORK_ROOT = os.environ.get("QCOWFS_TEST_TMP", "/var/tmp")  # as conftest.py's workdir

MiB = 1 << 20
SIZE = 16 * MiB
SRC_SIZE = 4 * MiB

CONFIGS = [(fmt, state, cache) for fmt in ("raw", "qcow2") for state in ("fresh", "data")
           for cache in ("none", "writeback")]
CHECKABLE = {"qcow2", "vmdk", "vhdx", "vdi"}  # the formats `qemu-img check` checks


@dataclass
class Disk:
    image: Path
    fmt: str
    cache: str
    model: bytearray  # what a block device of the same size would hold

    @property
    def opts(self) -> list[str]:
        return ["rw", f"cache={self.cache}"]


@functools.lru_cache(maxsize=None)
def random_bytes(seed: int, n: int) -> bytes:
    """The same bytes for the same (seed, n); kept (immutable): one 16 MiB
    randbytes call costs a quarter of a CPU-second."""
    return random.Random(seed).randbytes(n)


# Disks with data, made once per module and copied for each test (cp keeps
# holes): (fmt, size) -> the template image; see make_disk.
_DATA_DISKS: dict[tuple[str, int], Path] = {}
_template_dir: Path | None = None


@pytest.fixture(scope="module", autouse=True)
def data_disk_templates():
    global _template_dir
    _template_dir = Path(tempfile.mkdtemp(prefix="qcowfs-disk-tools-templates-", dir=WORK_ROOT))
    try:
        yield
    finally:
        _DATA_DISKS.clear()
        shutil.rmtree(_template_dir, ignore_errors=True)
        _template_dir = None


def make_disk(workdir: Path, fmt: str, state: str, cache: str, size: int = SIZE) -> Disk:
    """A disk with data is the same image for every test (seed 1, converted
    by qemu-img): made once (make_disk_in) and copied; a fresh one is made
    here each time (cheap, and its raw file stays a hole)."""
    if state != "data":
        return make_disk_in(workdir, fmt, state, cache, size)
    key = (fmt, size)
    if key not in _DATA_DISKS:
        assert _template_dir is not None
        where = _template_dir / f"{fmt}-{size}"
        where.mkdir()
        _DATA_DISKS[key] = make_disk_in(where, fmt, state, cache, size).image
    template = _DATA_DISKS[key]
    image = workdir / template.name
    helpers.run(["cp", "--sparse=auto", str(template), str(image)])
    return Disk(image, fmt, cache, bytearray(random_bytes(1, size)))


def make_disk_in(workdir: Path, fmt: str, state: str, cache: str, size: int = SIZE) -> Disk:
    raw = workdir / "disk.raw"
    with open(raw, "wb") as f:
        f.truncate(size)
        if state == "data":
            f.write(random_bytes(1, size))
    model = bytearray(raw.read_bytes())
    if fmt == "raw":
        return Disk(raw, fmt, cache, model)
    image = workdir / f"disk.{fmt}"
    if state == "data":
        helpers.qemu_img("convert", "-f", "raw", "-O", fmt, raw, image)
    else:
        helpers.qemu_img("create", "-q", "-f", fmt, image, str(size))
    raw.unlink()
    return Disk(image, fmt, cache, model)


def make_source(workdir: Path, size: int = SRC_SIZE, seed: int = 2) -> tuple[Path, bytes]:
    """A sparse source file: data, a hole in the middle, data at the end."""
    path = workdir / f"src-{size}.bin"
    quarter = size // 4
    with open(path, "wb") as f:
        f.write(random_bytes(seed, quarter))
        f.seek(3 * quarter)
        f.write(random_bytes(seed + 1, quarter))
    return path, path.read_bytes()


def check_image(disk: Disk, expected: bytes | bytearray | None = None) -> None:
    """The image as QEMU sees it equals the model (or `expected`), size included."""
    want = disk.model if expected is None else expected
    info = helpers.qemu_img_info(disk.image, fmt=disk.fmt)
    assert info["virtual-size"] == len(want), f"virtual size {info['virtual-size']}, want {len(want)}"
    ref = helpers.convert_to_raw(disk.image, disk.image.with_name("check.ref.raw"), fmt=disk.fmt)
    got = ref.read_bytes()
    if got != want:
        at = helpers.first_difference(got, bytes(want))
        raise AssertionError(f"image differs from the model at byte {at}")
    if disk.fmt in CHECKABLE:
        helpers.qemu_img_check(disk.image, disk.fmt)


def place(model: bytearray, off: int, data: bytes) -> None:
    model[off:off + len(data)] = data


@pytest.fixture(params=CONFIGS, ids=["-".join(c) for c in CONFIGS])
def disk(request, workdir: Path) -> Disk:
    return make_disk(workdir, *request.param)


# ---- copying onto the view ----

DD_VARIANTS = {
    "plain": [],
    "notrunc": ["conv=notrunc"],
    "direct": ["oflag=direct"],
    "fsync": ["conv=fsync"],
}


@pytest.mark.parametrize("variant", DD_VARIANTS)
def test_dd_writes_the_source_and_keeps_the_disk(disk: Disk, workdir: Path, variant: str) -> None:
    src, data = make_source(workdir)
    with helpers.mounted(disk.image, workdir / "view", disk.opts) as m:
        helpers.run(["dd", f"if={src}", f"of={m.path}", "bs=1M", "status=none", *DD_VARIANTS[variant]])
        assert os.path.getsize(m.path) == SIZE, "dd without conv=notrunc must not truncate a disk"
    place(disk.model, 0, data)
    check_image(disk)


@pytest.mark.parametrize("how", ["cp", "cp-sparse", "cat"])
def test_cp_and_shell_redirection_keep_the_disk(disk: Disk, workdir: Path, how: str) -> None:
    src, data = make_source(workdir)
    with helpers.mounted(disk.image, workdir / "view", disk.opts) as m:
        if how == "cp":
            helpers.run(["cp", src, m.path])
        elif how == "cp-sparse":
            helpers.run(["cp", "--sparse=always", src, m.path])  # punches the source's hole
        else:
            helpers.run(["sh", "-c", f'cat "{src}" > "{m.path}"'])
        assert os.path.getsize(m.path) == SIZE
    place(disk.model, 0, data)
    check_image(disk)


def test_python_open_for_writing_truncates_nothing(disk: Disk, workdir: Path) -> None:
    with helpers.mounted(disk.image, workdir / "view", disk.opts) as m:
        with open(m.path, "wb") as f:  # O_WRONLY|O_CREAT|O_TRUNC
            assert os.fstat(f.fileno()).st_size == SIZE
            f.write(b"written after O_TRUNC")
        with open(m.path, "rb") as f:
            assert f.read(21) == b"written after O_TRUNC"
            f.seek(SIZE - 4096)
            assert f.read() == bytes(disk.model[SIZE - 4096:])
    place(disk.model, 0, b"written after O_TRUNC")
    check_image(disk)


def test_qemu_img_convert_with_n_writes_into_the_disk(disk: Disk, workdir: Path) -> None:
    src, data = make_source(workdir)
    with helpers.mounted(disk.image, workdir / "view", disk.opts) as m:
        helpers.qemu_img("convert", "-n", "-f", "raw", "-O", "raw", src, m.path)
        assert os.path.getsize(m.path) == SIZE
    place(disk.model, 0, data)
    check_image(disk)


def make_convert_source(workdir: Path) -> tuple[Path, bytes]:
    """A source whose zeros qemu-img convert skips: data, a hole, data,
    written zeros, and a hole at the end."""
    path = workdir / "convert-src.raw"
    with open(path, "wb") as f:
        f.write(random_bytes(6, MiB))
        f.seek(2 * MiB)
        f.write(random_bytes(7, MiB // 2))
        f.write(bytes(MiB // 2))
        f.truncate(SRC_SIZE)
    return path, path.read_bytes()


def convert_without_n(disk: Disk, workdir: Path) -> None:
    """qemu-img's raw create opens the target, truncates it to 0, sizes it to
    the source with ftruncate, writes its first block and closes it; then it
    opens it again and writes only the source's data (a new file reads as
    zeros). The disk keeps its size, reads as the source up to the source's
    size (the data the disk had where the source has zeros included) and keeps
    its data past it."""
    src, data = make_convert_source(workdir)
    if any(disk.model):  # data where the source has zeros, and past it
        assert all(any(disk.model[a:b]) for a, b in ((MiB, 2 * MiB), (3 * MiB, SRC_SIZE), (SRC_SIZE, SIZE)))
    with helpers.mounted(disk.image, workdir / "view", disk.opts) as m:
        proc = helpers.run(["qemu-img", "convert", "-f", "raw", "-O", "raw", src, m.path], check=False)
        assert proc.returncode == 0, proc.stderr.decode()
        assert os.path.getsize(m.path) == SIZE
        # The view's first SRC_SIZE bytes (a raw driver limited to them) against the source.
        helpers.run(["qemu-img", "compare", "--image-opts", f"driver=raw,file.filename={src}",
                     f"driver=raw,size={SRC_SIZE},file.filename={m.path}"])
    place(disk.model, 0, data)
    check_image(disk)  # every byte: the source, then the disk's data past it


def test_qemu_img_convert_without_n(disk: Disk, workdir: Path) -> None:
    convert_without_n(disk, workdir)


@pytest.mark.parametrize("fmt", ["vmdk", "vhdx", "vdi"])
def test_qemu_img_convert_without_n_onto_other_formats(workdir: Path, fmt: str) -> None:
    convert_without_n(make_disk(workdir, fmt, "data", "none"), workdir)


@pytest.mark.parametrize("same_size", [True], ids=["same-size"])
def test_rsync_inplace(disk: Disk, workdir: Path, same_size: bool) -> None:
    src, data = make_source(workdir, SIZE if same_size else SRC_SIZE, seed=3)
    with helpers.mounted(disk.image, workdir / "view", disk.opts) as m:
        # -I: the view's mtime may equal the source's to the second.
        helpers.run(["rsync", "--inplace", "-I", str(src), str(m.path)])
        assert os.path.getsize(m.path) == SIZE
    check_image(disk, data)


# ---- resizing and ranges ----

def test_truncate_smaller(disk: Disk, workdir: Path) -> None:
    """Refused over data (EINVAL, nothing changes); allowed over holes. By
    path a truncate to 0 is a shrink like any other; `truncate -s 0` (an
    ftruncate through an open) is O_TRUNC: it succeeds and changes nothing."""
    empty = not any(disk.model)
    with helpers.mounted(disk.image, workdir / "view", disk.opts) as m:
        if not empty:
            for size in (0, 512, SIZE - 512):
                with pytest.raises(OSError) as e:
                    os.truncate(m.path, size)
                assert e.value.errno == errno.EINVAL, size
        helpers.run(["truncate", "-s", "0", m.path])
        assert os.path.getsize(m.path) == SIZE
        proc = helpers.run(["truncate", "-s", str(SIZE // 2), m.path], check=False)
        if empty:
            assert proc.returncode == 0, proc.stderr.decode()
        else:
            assert proc.returncode != 0 and b"Invalid argument" in proc.stderr, proc.stderr.decode()
        assert os.path.getsize(m.path) == (SIZE // 2 if empty else SIZE)
    check_image(disk, disk.model[:SIZE // 2] if empty else None)


def test_truncate_smaller_over_data_says_einval(disk: Disk, workdir: Path) -> None:
    with helpers.mounted(disk.image, workdir / "view", disk.opts) as m:
        with open(m.path, "r+b", buffering=0) as f:
            f.seek(SIZE - 512)
            f.write(b"\x5a" * 512)
            with pytest.raises(OSError) as e:
                os.ftruncate(f.fileno(), SIZE - 4096)
            assert e.value.errno == errno.EINVAL
            assert os.fstat(f.fileno()).st_size == SIZE
    place(disk.model, SIZE - 512, b"\x5a" * 512)
    check_image(disk)


def test_truncate_larger_grows_with_zeros(disk: Disk, workdir: Path) -> None:
    with helpers.mounted(disk.image, workdir / "view", disk.opts) as m:
        helpers.run(["truncate", "-s", str(SIZE + 3 * MiB), m.path])
        assert os.path.getsize(m.path) == SIZE + 3 * MiB
        with open(m.path, "r+b", buffering=0) as f:
            f.seek(SIZE + MiB)
            f.write(b"grown")
    disk.model.extend(bytes(3 * MiB))
    place(disk.model, SIZE + MiB, b"grown")
    check_image(disk)


@pytest.mark.parametrize("mode", ["-p", "-z"], ids=["punch", "zero"])
def test_fallocate_ranges_read_as_zeros(disk: Disk, workdir: Path, mode: str) -> None:
    with helpers.mounted(disk.image, workdir / "view", disk.opts) as m:
        helpers.run(["fallocate", mode, "-o", str(MiB + 512), "-l", str(2 * MiB), m.path])
        assert os.path.getsize(m.path) == SIZE
    place(disk.model, MiB + 512, bytes(2 * MiB))
    check_image(disk)


def test_dd_across_the_end_is_short(disk: Disk, workdir: Path) -> None:
    """dd of 2 MiB at 1 MiB before the end: 1 MiB written, then ENOSPC, as on a
    block device; nothing lands past the end (the image does not grow)."""
    src, data = make_source(workdir, 2 * MiB, seed=4)
    with helpers.mounted(disk.image, workdir / "view", disk.opts) as m:
        proc = helpers.run(["dd", f"if={src}", f"of={m.path}", "bs=2M", f"seek={SIZE - MiB}",
                            "oflag=seek_bytes", "conv=notrunc"], check=False)
        assert proc.returncode != 0
        assert b"No space left on device" in proc.stderr, proc.stderr.decode()
        assert os.path.getsize(m.path) == SIZE
        fd = os.open(m.path, os.O_WRONLY)
        try:
            assert os.pwrite(fd, b"x" * 8192, SIZE - 4096) == 4096
            with pytest.raises(OSError) as e:
                os.pwrite(fd, b"x", SIZE)
            assert e.value.errno == errno.ENOSPC
        finally:
            os.close(fd)
    place(disk.model, SIZE - MiB, data[:MiB])
    place(disk.model, SIZE - 4096, b"x" * 4096)
    check_image(disk)
    if disk.fmt == "raw":
        assert os.path.getsize(disk.image) == SIZE


# ---- mapping ----

def test_shared_mmap_is_coherent_and_durable(disk: Disk, workdir: Path) -> None:
    with helpers.mounted(disk.image, workdir / "view", disk.opts) as m:
        fd = os.open(m.path, os.O_RDWR)
        try:
            with mmap.mmap(fd, SIZE, mmap.MAP_SHARED) as mp:
                assert mp[:4096] == disk.model[:4096]
                mp[8192:8192 + 13] = b"mapped write!"
                mp.flush()  # msync(MS_SYNC)
                assert os.pread(fd, 13, 8192) == b"mapped write!"
                os.pwrite(fd, b"plain write", 3 * MiB)
                assert mp[3 * MiB:3 * MiB + 11] == b"plain write"
        finally:
            os.close(fd)
    place(disk.model, 8192, b"mapped write!")
    place(disk.model, 3 * MiB, b"plain write")
    check_image(disk)


# ---- partitioning ----

@pytest.mark.parametrize("fmt", ["raw", "qcow2"])
@pytest.mark.parametrize("label", ["dos", "gpt"])
def test_sfdisk_then_mkfs_at_once(workdir: Path, fmt: str, label: str) -> None:
    """mkfs on a partition right after sfdisk wrote the table, without listing
    partitions/ first; then the file systems check clean."""
    disk = make_disk(workdir, fmt, "fresh", "none", 64 * MiB)
    layout = {"dos": "label: dos\nstart=2048, size=40960, type=83\nstart=43008, type=5\n"
                     "start=45056, size=40000, type=c\n",
              "gpt": "label: gpt\nstart=2048, size=40960\nstart=43008, size=40000\n"}[label]
    second = "p5.raw" if label == "dos" else "p2.raw"
    mnt = workdir / "mnt"
    mnt.mkdir()
    with helpers.mounted(disk.image, mnt, disk.opts) as m:
        parts = mnt / "partitions"
        assert not (parts / "p1.raw").exists()  # a lookup of a name not there yet
        helpers.run(["sfdisk", "-q", str(m.path)], input=layout.encode())
        helpers.run(["mkfs.ext4", "-q", str(parts / "p1.raw")])
        helpers.run(["mkfs.vfat", str(parts / second)])
        assert os.path.getsize(parts / "p1.raw") == 40960 * 512
        assert os.path.getsize(parts / second) == 40000 * 512
        helpers.run(["e2fsck", "-fn", str(parts / "p1.raw")])
        helpers.run(["fsck.vfat", "-n", str(parts / second)])
    if fmt == "qcow2":
        helpers.qemu_img_check(disk.image)
    ref = helpers.convert_to_raw(disk.image, fmt=fmt)
    with open(ref, "rb") as f:
        f.seek(2048 * 512 + 1024 + 56)
        assert f.read(2) == b"\x53\xef", "no ext4 superblock at the first partition"


def test_repartitioning_gives_the_new_partition_not_the_old(workdir: Path) -> None:
    """A partition moved by a new table: the same name opens the new one."""
    disk = make_disk(workdir, "qcow2", "fresh", "none")
    mnt = workdir / "mnt"
    mnt.mkdir()
    with helpers.mounted(disk.image, mnt, disk.opts) as m:
        p1 = mnt / "partitions" / "p1.raw"
        helpers.run(["sfdisk", "-q", str(m.path)], input=b"label: dos\nstart=2048, size=8192, type=83\n")
        assert os.path.getsize(p1) == 8192 * 512
        helpers.run(["sfdisk", "-q", str(m.path)], input=b"label: dos\nstart=4096, size=16384, type=83\n")
        assert os.path.getsize(p1) == 16384 * 512
        with open(p1, "r+b", buffering=0) as f:
            f.write(b"first sector of the new p1")
    ref = helpers.convert_to_raw(disk.image, fmt="qcow2").read_bytes()
    assert ref[4096 * 512:4096 * 512 + 26] == b"first sector of the new p1"
    assert ref[2048 * 512:2048 * 512 + 26] != b"first sector of the new p1"


# ---- sparse copiers and seeks ----

def test_an_o_trunc_writer_reads_zeros_where_it_skipped(disk: Disk, workdir: Path) -> None:
    """Sparse copiers (cp, zstd -d, dd conv=sparse) open with O_TRUNC and seek
    over zero blocks instead of writing them: on close those ranges read as
    zeros, as in the empty file they asked for. Past the furthest write the
    disk keeps its data."""
    with helpers.mounted(disk.image, workdir / "view", disk.opts) as m:
        fd = os.open(m.path, os.O_WRONLY | os.O_TRUNC)
        try:
            os.lseek(fd, MiB, os.SEEK_SET)  # a leading hole
            os.write(fd, b"a" * 4096)
            os.lseek(fd, 2 * MiB, os.SEEK_CUR)  # a hole in the middle
            os.write(fd, b"b" * 4096)
        finally:
            os.close(fd)
        with open(m.path, "rb") as f:
            assert f.read(MiB) == bytes(MiB)
    end = 3 * MiB + 8192
    place(disk.model, 0, bytes(end))
    place(disk.model, MiB, b"a" * 4096)
    place(disk.model, 3 * MiB + 4096, b"b" * 4096)
    check_image(disk)


def test_dd_conv_sparse_copies_zeros_right(disk: Disk, workdir: Path) -> None:
    src, data = make_source(workdir)
    with helpers.mounted(disk.image, workdir / "view", disk.opts) as m:
        helpers.run(["dd", f"if={src}", f"of={m.path}", "bs=64K", "conv=sparse", "status=none"])
    place(disk.model, 0, data)
    check_image(disk)


def test_dd_seek_without_notrunc(disk: Disk, workdir: Path) -> None:
    """dd seek=N without conv=notrunc truncates the output to N first. Over
    data that is a refused shrink: dd says so and writes at N, and the disk
    keeps its size, as on a block device. On a disk whose tail is empty the
    tail goes (a shrink over holes) and the write is cut at the new end."""
    src, data = make_source(workdir, MiB, seed=5)
    with helpers.mounted(disk.image, workdir / "view", disk.opts) as m:
        proc = helpers.run(["dd", f"if={src}", f"of={m.path}", "bs=1M", "seek=2", "status=none"], check=False)
        if any(disk.model[2 * MiB:]):
            assert b"failed to truncate" in proc.stderr and b"Invalid argument" in proc.stderr, proc.stderr.decode()
            assert os.path.getsize(m.path) == SIZE
            place(disk.model, 2 * MiB, data)
        else:
            # The empty tail goes (a shrink over holes), then the write lands up to the new end.
            assert os.path.getsize(m.path) == 2 * MiB
            del disk.model[2 * MiB:]
    check_image(disk)
