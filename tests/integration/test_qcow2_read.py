"""qcow2 read path through a real mount (issue 3's acceptance matrix).

For every image of tests/qcowfs_testlib/qcow2_matrix.py:
  * the mounted raw view is byte-identical to `qemu-img convert -O raw`;
  * SEEK_DATA/SEEK_HOLE through the mount agree with `qemu-img map` (the rule
    is written down in helpers.py above data_extents());
  * the image and every file of its chain keep their sha256 and mtime.
Plus concurrent readers, internal snapshots in both exposure modes, and
hostile headers refused at mount time with a message and a non-zero exit.
"""

from __future__ import annotations

import errno
import mmap
import os
import random
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from qcowfs_testlib import helpers
from qcowfs_testlib import qcow2_meta
from qcowfs_testlib import qcow2_matrix

MiB = 1 << 20


def build(case: str, workdir: Path) -> qcow2_matrix.Image:
    out = workdir / "img"
    out.mkdir()
    return qcow2_matrix.build(case, out)


def fingerprints(files: list[Path]) -> dict[str, tuple[str, int, int]]:
    """sha256, mtime and size of each file: what a read-only mount must not change."""
    return {str(f): (helpers.sha256_file(f), os.stat(f).st_mtime_ns, os.stat(f).st_size)
            for f in files}


def virtual_size(image: Path) -> int:
    return helpers.qemu_img_info(image)["virtual-size"]


# --------------------------------------------------------------------------
# The matrix


@pytest.mark.parametrize("case", list(qcow2_matrix.CASES))
def test_read_matches_qemu(case, workdir):
    image = build(case, workdir)
    ref = helpers.convert_to_raw(image.path, workdir / "ref.raw")
    entries = helpers.qemu_img_map(image.path)
    before = fingerprints(image.files)
    with helpers.mounted(image.path, workdir / "view.raw") as m:
        assert os.path.getsize(m.path) == virtual_size(image.path)
        helpers.files_equal(m.path, ref)
        helpers.assert_map_agrees(entries, helpers.data_extents(m.path))
    assert fingerprints(image.files) == before, "a read-only mount changed the image"


@pytest.mark.parametrize("case", ["cluster_4k", "backing_chain_raw_base", "extended_l2_16k"])
def test_directory_mode_matches_qemu(case, workdir):
    image = build(case, workdir)
    ref = helpers.convert_to_raw(image.path, workdir / "ref.raw")
    mnt = workdir / "mnt"
    mnt.mkdir()
    with helpers.mounted(image.path, mnt) as m:
        assert m.path.name in os.listdir(mnt)
        helpers.files_equal(m.path, ref)
        helpers.assert_map_agrees(helpers.qemu_img_map(image.path),
                                  helpers.data_extents(m.path))


@pytest.mark.parametrize("case", ["compressed_zstd_64k", "backing_chain_raw_base",
                                  "extended_l2_64k_backing", "cluster_512"])
def test_concurrent_readers(case, workdir):
    """Eight threads of unaligned preads at random offsets, each checked against qemu."""
    image = build(case, workdir)
    ref = helpers.convert_to_raw(image.path, workdir / "ref.raw")
    size = os.path.getsize(ref)
    with helpers.mounted(image.path, workdir / "view.raw") as m:
        fd_view, fd_ref = os.open(m.path, os.O_RDONLY), os.open(ref, os.O_RDONLY)
        try:
            def reader(seed: int) -> int:
                rng = random.Random(seed)
                for _ in range(150):
                    length = rng.choice([1, 4096, 65536, 300_001, 1 << 20])
                    off = rng.randrange(0, size - length)
                    got = os.pread(fd_view, length, off)
                    want = os.pread(fd_ref, length, off)
                    if got != want:
                        i = helpers.first_difference(got, want)
                        raise AssertionError(f"thread {seed}: read of {length} at {off} differs "
                                             f"at offset {off + i}")
                return seed
            with ThreadPoolExecutor(max_workers=8) as pool:
                assert sorted(pool.map(reader, range(8))) == list(range(8))
        finally:
            os.close(fd_view)
            os.close(fd_ref)


@pytest.mark.parametrize("case", ["cluster_512", "compressed_zstd_64k", "backing_chain_raw_base"])
def test_o_direct_reads(case, workdir):
    """A VMM opens the view with O_DIRECT: aligned reads of many sizes must match."""
    image = build(case, workdir)
    ref = helpers.convert_to_raw(image.path, workdir / "ref.raw")
    size = os.path.getsize(ref)
    rng = random.Random(case)
    buf = mmap.mmap(-1, 4 * MiB)  # page aligned, as O_DIRECT wants
    with helpers.mounted(image.path, workdir / "view.raw") as m:
        fd = os.open(m.path, os.O_RDONLY | os.O_DIRECT)
        try:
            with open(ref, "rb", buffering=0) as r:
                for _ in range(60):
                    length = rng.choice([4096, 8192, 65536, 1 * MiB, 4 * MiB])
                    off = rng.randrange(0, (size - length) // 4096) * 4096
                    got = os.preadv(fd, [memoryview(buf)[:length]], off)
                    assert got == length, f"short O_DIRECT read at {off}: {got} of {length}"
                    want = os.pread(r.fileno(), length, off)
                    assert buf[:length] == want, f"O_DIRECT read of {length} at {off} differs"
        finally:
            os.close(fd)
            buf.close()


@pytest.mark.parametrize("case", ["cluster_512", "cluster_4k", "extended_l2_16k",
                                  "backing_chain_raw_base"])
def test_small_l2_cache_option(case, workdir):
    """A 16 KiB L2 cache (a few slices) evicts constantly and must still read right."""
    image = build(case, workdir)
    ref = helpers.convert_to_raw(image.path, workdir / "ref.raw")
    with helpers.mounted(image.path, workdir / "view.raw", ["l2_cache_size=16K"]) as m:
        helpers.files_equal(m.path, ref)
        helpers.assert_map_agrees(helpers.qemu_img_map(image.path),
                                  helpers.data_extents(m.path))


def test_daemon_mode_mount(workdir):
    image = build("compressed_zlib_64k", workdir)
    ref = helpers.convert_to_raw(image.path, workdir / "ref.raw")
    with helpers.mounted(image.path, workdir / "view.raw", foreground=False) as m:
        assert m.daemon_pids, "no daemon process found after mounting without -f"
        helpers.files_equal(m.path, ref)


def test_format_raw_option_shows_the_container(workdir):
    """-o format=raw wins over probing: the view is the qcow2 file's own bytes."""
    image = build("cluster_4k", workdir)
    with helpers.mounted(image.path, workdir / "view.raw", ["format=raw"]) as m:
        helpers.files_equal(m.path, image.path)


def test_st_blocks_reflects_allocation(workdir):
    image = build("cluster_64k", workdir)  # 600 MiB virtual, a few MiB allocated
    size = virtual_size(image.path)
    with helpers.mounted(image.path, workdir / "view.raw") as m:
        st = os.stat(m.path)
        assert st.st_size == size
        assert 0 < st.st_blocks * 512 < size // 10, (
            f"st_blocks={st.st_blocks} does not reflect a sparsely allocated image")


def test_reads_past_end_are_short(workdir):
    image = build("cluster_4k", workdir)
    ref = helpers.convert_to_raw(image.path, workdir / "ref.raw")
    size = os.path.getsize(ref)
    with helpers.mounted(image.path, workdir / "view.raw") as m:
        with open(m.path, "rb", buffering=0) as f, open(ref, "rb", buffering=0) as r:
            tail = os.pread(f.fileno(), 1 << 20, size - 1000)
            assert tail == os.pread(r.fileno(), 1000, size - 1000)
            assert os.pread(f.fileno(), 4096, size) == b""


@pytest.mark.parametrize("case", ["backing_chain_raw_base", "external_data_file",
                                  "dirty_lazy_refcounts", "persistent_bitmaps"])
def test_read_only_mount_never_opens_for_writing(case, workdir):
    """The whole chain sits on a read-only bind mount: any open for writing fails EROFS.

    (Dirty images, bitmaps in use and autoclear bits are what tempt a driver to write.)
    """
    image = build(case, workdir)
    ref = helpers.convert_to_raw(image.path, workdir / "ref.raw")
    ro = workdir / "ro"
    ro.mkdir()
    helpers.run(["mount", "--bind", workdir / "img", ro])
    try:
        helpers.run(["mount", "-o", "remount,ro,bind", ro])
        ro_image = ro / image.path.relative_to(workdir / "img")
        with helpers.mounted(ro_image, workdir / "view.raw") as m:
            helpers.files_equal(m.path, ref)
    finally:
        helpers.run(["umount", ro], check=False)


def test_read_only_mount_refuses_writes(workdir):
    image = build("cluster_64k", workdir)
    before = fingerprints(image.files)
    with helpers.mounted(image.path, workdir / "view.raw") as m:
        with pytest.raises(OSError) as err:
            fd = os.open(m.path, os.O_WRONLY)
            try:
                os.pwrite(fd, b"x" * 4096, 0)
            finally:
                os.close(fd)
        assert err.value.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
    assert fingerprints(image.files) == before


# --------------------------------------------------------------------------
# Internal snapshots


# `qemu-img convert -l snapshot.name=X` renders a snapshot at the image's
# *current* virtual size (QEMU loads only the snapshot's L1 table), while qcowfs
# shows each snapshot with its own disk size from the snapshot table. So a
# snapshot view must equal the first disk_size bytes of QEMU's rendering, and
# QEMU's rendering must be all zeros past disk_size (nothing is hidden).


def snapshot_refs(image: qcow2_matrix.Image, workdir: Path) -> dict[str, tuple[Path, int]]:
    """name -> (qemu-img's rendering, the snapshot's disk size from the table)."""
    sizes = {s["name"]: s["disk_size"] for s in qcow2_meta.read_snapshots(image.path)}
    refs = {}
    for name in image.snapshots:
        ref = helpers.convert_to_raw(image.path, workdir / f"{name}.ref", snapshot=name)
        size = sizes[name]
        assert size is not None and size <= os.path.getsize(ref)
        with open(ref, "rb") as f:
            f.seek(size)
            while block := f.read(helpers.CHUNK):
                assert block.count(0) == len(block), f"qemu shows data past {name}'s disk size"
        refs[name] = (ref, size)
    return refs


def test_snapshots_in_directory_mode(workdir):
    image = build("internal_snapshots", workdir)
    refs = snapshot_refs(image, workdir)
    current = helpers.convert_to_raw(image.path, workdir / "current.ref")
    before = fingerprints(image.files)
    mnt = workdir / "mnt"
    mnt.mkdir()
    with helpers.mounted(image.path, mnt) as m:
        assert sorted(os.listdir(mnt / "snapshots")) == sorted(f"{s}.raw" for s in refs)
        helpers.files_equal(m.path, current)
        for name, (ref, size) in refs.items():
            snap = m.snapshot_path(name)
            assert os.path.getsize(snap) == size, f"size of snapshot {name}"
            helpers.files_equal(snap, ref, length=size)
        with pytest.raises(OSError) as err:
            os.close(os.open(m.snapshot_path("first"), os.O_WRONLY))
        assert err.value.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
    assert fingerprints(image.files) == before


def test_snapshot_option_mounts_one_snapshot(workdir):
    image = build("internal_snapshots", workdir)
    refs = snapshot_refs(image, workdir)
    for name, (ref, size) in refs.items():
        with helpers.mounted(image.path, workdir / f"{name}.view", [f"snapshot={name}"]) as m:
            assert os.path.getsize(m.path) == size, f"size of snapshot {name}"
            helpers.files_equal(m.path, ref, length=size)
    assert len({size for _, size in refs.values()}) == 2, "snapshots should differ in size"


def test_snapshot_option_unknown_name_is_refused(workdir):
    image = build("internal_snapshots", workdir)
    code, text = helpers.mount_fails(image.path, workdir / "view.raw", ["snapshot=nosuch"])
    assert "nosuch" in text, text


# --------------------------------------------------------------------------
# Hostile headers: refused at mount time, with a message and a non-zero exit


def small_image(workdir: Path, name: str = "hostile.qcow2") -> Path:
    img = workdir / name
    helpers.qemu_img("create", "-q", "-f", "qcow2", img, "16M")
    helpers.qemu_io(img, "write -q -P 7 0 1M")
    return img


def backing_loop(workdir: Path) -> Path:
    a, b = workdir / "a.qcow2", workdir / "b.qcow2"
    helpers.qemu_img("create", "-q", "-f", "qcow2", a, "16M")
    helpers.qemu_img("create", "-q", "-f", "qcow2", "-b", a.name, "-F", "qcow2", b, "16M")
    helpers.qemu_img("rebase", "-u", "-f", "qcow2", "-b", b.name, "-F", "qcow2", a)
    return b


def patched(**fields):
    def make(workdir: Path) -> Path:
        img = small_image(workdir)
        for name, value in fields.items():
            qcow2_meta.set_field(img, name, value)
        return img
    return make


def incompatible_bit(bit: int, name: str | None = None):
    def make(workdir: Path) -> Path:
        img = small_image(workdir)
        qcow2_meta.set_incompatible_bit(img, bit, name)
        return img
    return make


HOSTILE = {
    # case: (image maker, what the message must mention)
    "unknown_incompatible_bit": (incompatible_bit(20), r"incompatible|feature|unsupported"),
    "named_incompatible_feature": (incompatible_bit(21, "frobnicator"), r"frobnicator"),
    "crypt_method_aes": (patched(crypt_method=1), r"encrypt"),
    "crypt_method_luks": (patched(crypt_method=2), r"encrypt"),
    "cluster_bits_30": (patched(cluster_bits=30), r"cluster"),
    "cluster_bits_8": (patched(cluster_bits=8), r"cluster"),
    "version_4": (patched(version=4), r"version"),
    "refcount_order_7": (patched(refcount_order=7), r"refcount"),
    "l1_table_unaligned": (patched(l1_table_offset=0x30001), r"l1"),
    "l1_size_absurd": (patched(l1_size=0x7FFFFFFF), r"l1"),
    "backing_loop": (backing_loop, r"loop|circular|cycle|recurs|chain|depth"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_header_is_refused(case, workdir):
    make, pattern = HOSTILE[case]
    img = make(workdir)
    before = fingerprints([img])
    code, text = helpers.mount_fails(img, workdir / "view.raw")
    assert 0 < code < 128, f"qcowfs died from a signal or odd code {code}:\n{text}"
    assert text.strip(), "refused without any message"
    assert re.search(pattern, text, re.IGNORECASE), f"message does not name the problem:\n{text}"
    assert fingerprints([img]) == before, "refusing the image changed it"


def test_hostile_header_refused_in_daemon_mode(workdir):
    """Without -f the launching process must still report the failure."""
    img = incompatible_bit(20)(workdir)
    target = workdir / "view.raw"
    target.touch()
    proc = helpers.run([helpers.qcowfs_bin(), str(img), str(target)], check=False, timeout=20)
    mounted_anyway = helpers.is_fuse_mounted(target)
    if mounted_anyway:
        helpers.unmount(target)
    assert not mounted_anyway
    assert proc.returncode != 0
    assert proc.stderr.strip(), "daemon mode refused without a message on stderr"


def test_copying_the_image_keeps_relative_backing_names(workdir):
    """The chain resolves relative names from each image's own directory, not the cwd."""
    image = build("backing_chain_raw_base", workdir)
    ref = helpers.convert_to_raw(image.path, workdir / "ref.raw")
    moved = workdir / "moved"
    shutil.copytree(workdir / "img", moved)
    elsewhere = Path("/")
    old_cwd = os.getcwd()
    os.chdir(elsewhere)
    try:
        with helpers.mounted(moved / "top" / "top.qcow2", workdir / "view.raw") as m:
            helpers.files_equal(m.path, ref)
    finally:
        os.chdir(old_cwd)
