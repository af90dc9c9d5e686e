"""`qcowfs check` cross-checked against `qemu-img check`.

Each case builds an image with qemu-img/qemu-io, damages bytes where the case
says (qcow2_meta), then asserts that qcowfs check reports the same numbers of
corruptions, leaks and check errors, the same exit code and the same
image-end-offset and cluster statistics as qemu-img check. Repairs are judged
by qemu-img: after `qcowfs check -r leaks|all`, qemu-img check must give the
result qemu-img's own repair of a copy gives (clean wherever qemu can fix it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from pathlib import Path

import pytest

from qcowfs_testlib import helpers
from qcowfs_testlib import qcow2_meta
from qcowfs_testlib.qcow2_meta import COPIED, OFFSET_MASK, Qcow2

MiB = 1 << 20
COUNTERS = ("corruptions", "leaks", "check-errors")
STATS = ("image-end-offset", "total-clusters", "allocated-clusters", "fragmented-clusters",
         "compressed-clusters")


def qemu_check(image: Path, *extra: str) -> tuple[int, dict]:
    proc = helpers.run(["qemu-img", "check", "--output=json", *extra, image], check=False)
    try:
        return proc.returncode, json.loads(proc.stdout.decode() or "{}")
    except json.JSONDecodeError:
        return proc.returncode, {}


def our_check(qcowfs: str, image: Path, *extra: str) -> tuple[int, dict]:
    proc = helpers.run([qcowfs, "check", "--json", *extra, image], check=False)
    text = proc.stdout.decode()
    assert text, f"qcowfs check printed no JSON (exit {proc.returncode}): {proc.stderr.decode()}"
    return proc.returncode, json.loads(text)


def counters(report: dict, keys=COUNTERS) -> dict:
    return {k: report.get(k, 0) for k in keys}


def base_image(workdir: Path, *opts: str, snapshot: bool = False) -> Path:
    img = workdir / "base.qcow2"
    helpers.qemu_img("create", "-q", "-f", "qcow2", *(["-o", ",".join(opts)] if opts else []), img, "64M")
    helpers.qemu_io(img, "write -P 0x11 0 1M", "write -P 0x22 5M 192k", "write -c -P 0x33 9M 64k",
                    "write -P 0x44 33M 64k")
    if snapshot:
        helpers.qemu_img("snapshot", "-c", "snap1", img)
        helpers.qemu_io(img, "write -P 0x55 0 128k")
    return img


# ---- damage: each takes the image and returns nothing; comments say what qemu reports


def leak_appended_cluster(q: Qcow2) -> None:
    """A cluster appended to the file with refcount 1 and no user: one leak."""
    end = q.file_size()
    q.write(end, b"\0" * q.cs)
    q.set_refcount(end // q.cs, 1)


def leak_two_clusters(q: Qcow2) -> None:
    end = q.file_size()
    q.write(end, b"\0" * 2 * q.cs)
    q.set_refcount(end // q.cs, 1)
    q.set_refcount(end // q.cs + 1, 3)


def data_refcount_two(q: Qcow2) -> None:
    """Refcount 2 on a data cluster: a leak, and OFLAG_COPIED now wrong."""
    i, j = q.first_data_entry()
    host = q.u64(q.l2_entry_offset(i, j)) & OFFSET_MASK
    q.set_refcount(host // q.cs, 2)


def data_refcount_zero(q: Qcow2) -> None:
    """Refcount 0 on a data cluster in use: a corruption (and a wrong copied flag)."""
    i, j = q.first_data_entry()
    host = q.u64(q.l2_entry_offset(i, j)) & OFFSET_MASK
    q.set_refcount(host // q.cs, 0)


def l2_table_refcount_zero(q: Qcow2) -> None:
    q.set_refcount(q.l2_offset(0) // q.cs, 0)


def entry_outside_file(q: Qcow2) -> None:
    """An L2 entry pointing ten clusters past the end of the file."""
    i, j = q.first_data_entry()
    far = (q.file_size() // q.cs + 10) * q.cs
    q.put_u64(q.l2_entry_offset(i, j), far | COPIED)


def misaligned_data_offset(q: Qcow2) -> None:
    i, j = q.first_data_entry()
    pos = q.l2_entry_offset(i, j)
    q.put_u64(pos, q.u64(pos) + 512)


def data_overlaps_l1(q: Qcow2) -> None:
    """A data cluster mapped onto the L1 table: overlapping metadata."""
    i, j = q.first_data_entry()
    q.put_u64(q.l2_entry_offset(i, j), (q.l1_offset & ~(q.cs - 1)) | COPIED)


def copied_flag_cleared(q: Qcow2) -> None:
    i, j = q.first_data_entry()
    pos = q.l2_entry_offset(i, j)
    q.put_u64(pos, q.u64(pos) & ~COPIED)


def l1_copied_flag_cleared(q: Qcow2) -> None:
    pos = q.l1_entry_offset(0)
    q.put_u64(pos, q.u64(pos) & ~COPIED)


def reftable_entry_misaligned(q: Qcow2) -> None:
    """A refcount table entry off the cluster grid: the structure must be rebuilt."""
    q.put_u64(q.reftable_offset, q.u64(q.reftable_offset) + 4096)


def reftable_entry_outside(q: Qcow2) -> None:
    q.put_u64(q.reftable_offset + 8, (q.file_size() // q.cs + 100) * q.cs)


def subcluster_alloc_and_zero(q: Qcow2) -> None:
    """Extended L2: a subcluster both allocated and zero."""
    i, j = q.first_data_entry()
    pos = q.l2_entry_offset(i, j) + 8
    bitmap = q.u64(pos)
    q.put_u64(pos, bitmap | ((bitmap & 0xFFFFFFFF) << 32))


def unallocated_with_alloc_bits(q: Qcow2) -> None:
    """Extended L2: an unallocated cluster whose bitmap claims allocated subclusters."""
    i, _ = q.first_data_entry()
    for j in range(q.cs // q.l2_entry_size):
        pos = q.l2_entry_offset(i, j)
        if q.u64(pos) == 0:
            q.put_u64(pos + 8, 0x1)
            return
    raise AssertionError("no unallocated L2 entry found")


CASES = {
    "clean": ((), False, None),
    "clean_snapshot": ((), True, None),
    "clean_refcount_bits_1": (("refcount_bits=1",), False, None),
    "clean_v2": (("compat=0.10",), False, None),
    "leak_appended": ((), False, leak_appended_cluster),
    "leak_two_refcount_bits_4": (("refcount_bits=4",), False, leak_two_clusters),
    "leak_refcount_bits_64": (("refcount_bits=64",), False, leak_appended_cluster),
    "leak_with_snapshot": ((), True, leak_appended_cluster),
    "data_refcount_two": ((), False, data_refcount_two),
    "data_refcount_zero": ((), False, data_refcount_zero),
    "data_refcount_zero_snapshot": ((), True, data_refcount_zero),
    "l2_table_refcount_zero": ((), False, l2_table_refcount_zero),
    "entry_outside_file": ((), False, entry_outside_file),
    "misaligned_data_offset": ((), False, misaligned_data_offset),
    "data_overlaps_l1": ((), False, data_overlaps_l1),
    "copied_flag_cleared": ((), False, copied_flag_cleared),
    "l1_copied_flag_cleared": ((), False, l1_copied_flag_cleared),
    "reftable_entry_misaligned": ((), False, reftable_entry_misaligned),
    "reftable_entry_outside": ((), False, reftable_entry_outside),
    "extended_l2_clean": (("extended_l2=on",), False, None),
    "subcluster_alloc_and_zero": (("extended_l2=on",), False, subcluster_alloc_and_zero),
    "unallocated_with_alloc_bits": (("extended_l2=on",), False, unallocated_with_alloc_bits),
}


def make_case(workdir: Path, name: str) -> Path:
    opts, snapshot, damage = CASES[name]
    img = base_image(workdir, *opts, snapshot=snapshot)
    if damage:
        damage(Qcow2(img))
    return img


@pytest.mark.parametrize("name", sorted(CASES))
def test_check_agrees_with_qemu(workdir: Path, qcowfs: str, name: str) -> None:
    img = make_case(workdir, name)
    q_rc, q_rep = qemu_check(img)
    o_rc, o_rep = our_check(qcowfs, img)
    assert counters(o_rep) == counters(q_rep), f"qemu: {q_rep}\nqcowfs: {o_rep}"
    assert o_rc == q_rc
    if q_rep.get("check-errors", 0) == 0:
        assert counters(o_rep, STATS) == counters(q_rep, STATS), f"qemu: {q_rep}\nqcowfs: {o_rep}"
    if CASES[name][2] is not None:
        assert q_rc != 0, "the damage should be visible to qemu-img check"


@pytest.mark.parametrize("mode", ["leaks", "all"])
@pytest.mark.parametrize("name", sorted(n for n in CASES if CASES[n][2] is not None))
def test_repair_judged_by_qemu(workdir: Path, qcowfs: str, name: str, mode: str) -> None:
    img = make_case(workdir, name)
    theirs = workdir / "qemu-repaired.qcow2"
    shutil.copyfile(img, theirs)
    helpers.run(["qemu-img", "check", "-r", mode, theirs], check=False)
    q_after_rc, q_after = qemu_check(theirs)
    o_rc, o_rep = our_check(qcowfs, img, "-r", mode)
    after_rc, after = qemu_check(img)
    # Our report after repair is what qemu-img now sees in the image.
    assert counters(o_rep) == counters(after), f"qcowfs -r {mode}: {o_rep}\nqemu after: {after}"
    assert o_rc == after_rc
    # And we repair at least what qemu's own repair does.
    assert after_rc <= q_after_rc or after_rc in (0, 3) and q_after_rc in (0, 3) and \
        after.get("leaks", 0) <= q_after.get("leaks", 0), (
        f"qemu's own -r {mode} leaves {q_after}, ours leaves {after}")
    if q_after_rc == 0:
        assert after_rc == 0, f"qemu's -r {mode} cleans this image, ours leaves {after}"
    if after_rc == 0:
        helpers.qemu_img("convert", "-O", "raw", img, workdir / "readable.raw")


def test_repaired_leaks_keep_data(workdir: Path, qcowfs: str) -> None:
    img = make_case(workdir, "leak_two_refcount_bits_4")
    before = helpers.convert_to_raw(img, workdir / "before.raw")
    rc, rep = our_check(qcowfs, img, "-r", "leaks")
    assert rc == 0 and rep.get("leaks-fixed") == 2, rep
    helpers.qemu_img_check(img)
    after = helpers.convert_to_raw(img, workdir / "after.raw")
    assert helpers.files_equal(before, after)


def test_rebuilt_refcounts_keep_data_and_snapshots(workdir: Path, qcowfs: str) -> None:
    img = make_case(workdir, "data_refcount_zero_snapshot")
    before = helpers.convert_to_raw(img, workdir / "before.raw")
    snap_before = helpers.convert_to_raw(img, workdir / "snap-before.raw", snapshot="snap1")
    rc, rep = our_check(qcowfs, img, "-r", "all")
    assert rc == 0 and rep.get("corruptions-fixed", 0) > 0, rep
    helpers.qemu_img_check(img)
    assert helpers.files_equal(before, helpers.convert_to_raw(img, workdir / "after.raw"))
    assert helpers.files_equal(snap_before, helpers.convert_to_raw(img, workdir / "snap-after.raw",
                                                                   snapshot="snap1"))
    # The repaired image takes writes that qemu then finds consistent.
    helpers.qemu_io(img, "write -P 0x66 2M 1M")
    helpers.qemu_img_check(img)


def test_dirty_lazy_refcounts_image(workdir: Path, qcowfs: str) -> None:
    img = workdir / "dirty.qcow2"
    helpers.qemu_img("create", "-q", "-f", "qcow2", "-o", "lazy_refcounts=on", img, "16M")
    helpers.run(["qemu-io", "-f", "qcow2", "-c", "write -P 1 0 1M", "-c", "write -P 2 4M 64k", "-c", "abort",
                 img], check=False)
    assert qcow2_meta.get_field(img, "incompatible_features") & qcow2_meta.INCOMPAT_DIRTY
    q_rc, q_rep = qemu_check(img)
    o_rc, o_rep = our_check(qcowfs, img)
    assert (o_rc, counters(o_rep)) == (q_rc, counters(q_rep))
    assert q_rc != 0, "a dirty lazy-refcount image has refcounts to repair"
    rc, _ = our_check(qcowfs, img, "-r", "all")
    assert rc == 0
    helpers.qemu_img_check(img)
    assert not qcow2_meta.get_field(img, "incompatible_features") & qcow2_meta.INCOMPAT_DIRTY


def test_bitmaps_are_counted(workdir: Path, qcowfs: str) -> None:
    img = base_image(workdir)
    helpers.qemu_img("bitmap", "--add", img, "b0")
    helpers.qemu_img("bitmap", "--add", "-g", "128k", img, "b1")
    helpers.qemu_io(img, "write -P 7 8M 1M")  # dirties the auto bitmaps in memory only
    helpers.run(["qemu-img", "convert", "-O", "qcow2", "--bitmaps", img, workdir / "with-bitmaps.qcow2"])
    copy = workdir / "with-bitmaps.qcow2"
    q_rc, q_rep = qemu_check(copy)
    o_rc, o_rep = our_check(qcowfs, copy)
    assert q_rc == 0 and o_rc == 0
    assert counters(o_rep, STATS) == counters(q_rep, STATS)
    # A bitmap table cluster with refcount 0 must be found, like qemu finds it.
    q = Qcow2(copy)
    ext = dict(qcow2_meta.read_extensions(copy))[0x23852875]
    dir_offset = struct.unpack(">Q", ext[16:24])[0]
    table_offset = struct.unpack(">Q", q.read(dir_offset, 8))[0]
    q.set_refcount(table_offset // q.cs, 0)
    q_rc, q_rep = qemu_check(copy)
    o_rc, o_rep = our_check(qcowfs, copy)
    assert q_rc == 2 and (o_rc, counters(o_rep)) == (q_rc, counters(q_rep))


def test_exit_codes_and_human_output(workdir: Path, qcowfs: str) -> None:
    img = make_case(workdir, "leak_appended")
    proc = helpers.run([qcowfs, "check", img], check=False)
    assert proc.returncode == 3
    assert b"1 leaked clusters were found on the image." in proc.stdout
    assert b"Leaked cluster" in proc.stderr
    raw = workdir / "disk.raw"
    raw.write_bytes(b"\0" * 4096)
    assert helpers.run([qcowfs, "check", raw], check=False).returncode == 63
    assert helpers.run([qcowfs, "check", workdir / "missing.qcow2"], check=False).returncode == 1
    # No progress bar on a pipe.
    assert b"\r" not in helpers.run([qcowfs, "check", make_case(workdir, "clean")], check=False).stderr


def test_image_written_through_a_mount(workdir: Path, qcowfs: str) -> None:
    """An image qcowfs itself wrote: both checkers agree it is clean."""
    img = base_image(workdir, "cluster_size=4K", snapshot=True)
    mnt = workdir / "mnt"
    mnt.mkdir()
    with helpers.mounted(img, mnt, ["rw"]) as m:
        with open(m.path, "r+b") as f:
            for i in range(40):
                f.seek((i * 1_234_567) % (60 * MiB))
                f.write(bytes([i]) * (3000 + i * 97))
            os.fsync(f.fileno())
    q_rc, q_rep = qemu_check(img)
    o_rc, o_rep = our_check(qcowfs, img)
    assert q_rc == 0, q_rep
    assert (o_rc, counters(o_rep), counters(o_rep, STATS)) == (q_rc, counters(q_rep), counters(q_rep, STATS))


@pytest.mark.parametrize("lazy", ["on", "off"])
def test_image_left_by_a_killed_writer(workdir: Path, qcowfs: str, lazy: str) -> None:
    """kill -9 of a read-write mount: both checkers agree on what is left, and
    `qcowfs check -r all` leaves an image qemu-img finds clean and readable."""
    img = workdir / "crash.qcow2"
    helpers.qemu_img("create", "-q", "-f", "qcow2", "-o", f"cluster_size=4K,lazy_refcounts={lazy}", img, "32M")
    mnt = workdir / "mnt"
    mnt.mkdir()
    with helpers.mounted(img, mnt, ["rw"], expect_exit=None) as m:
        fd = os.open(m.path, os.O_RDWR)
        try:
            for i in range(64):
                os.pwrite(fd, bytes([i + 1]) * 8192, (i * 397 * 4096) % (31 * MiB))
        finally:
            os.close(fd)
        m.proc.kill()
        m.proc.wait(timeout=10)
    q_rc, q_rep = qemu_check(img)
    o_rc, o_rep = our_check(qcowfs, img)
    assert (o_rc, counters(o_rep)) == (q_rc, counters(q_rep)), f"qemu: {q_rep}\nqcowfs: {o_rep}"
    rc, _ = our_check(qcowfs, img, "-r", "all")
    assert rc == 0
    helpers.qemu_img_check(img)
    helpers.convert_to_raw(img, workdir / "after.raw")


@pytest.mark.parametrize("holder", ["mount", "qemu-io"])
def test_image_in_use(workdir: Path, qcowfs: str, holder: str) -> None:
    """A leaky image a rw mount or qemu-io holds: check -r is refused naming the lock
    before it writes anything (the image stays byte-identical); check alone is refused
    with the -U hint; check -U (--force-share) reports what qemu-img check -U reports."""
    img = make_case(workdir, "leak_appended")
    with helpers.held_read_write(img, holder, workdir):
        before = helpers.sha256_file(img)
        for extra in (["-r", "leaks"], ["-r", "all"], []):
            proc = helpers.run([qcowfs, "check", *extra, img], check=False)
            text = proc.stderr.decode(errors="replace")
            lock = helpers.WRITE_LOCK_REFUSED if extra else helpers.SHARED_WRITE_LOCK_REFUSED
            assert proc.returncode == 1 and re.search(lock, text, re.I), (extra, text)
            assert helpers.sha256_file(img) == before, f"check {extra} changed the image in use"
        assert "-U" in text, text
        q_rc, q_rep = qemu_check(img, "-U")
        assert q_rc == 3, q_rep
        for flag in ("-U", "--force-share"):
            o_rc, o_rep = our_check(qcowfs, img, flag)
            assert (o_rc, counters(o_rep)) == (q_rc, counters(q_rep))
        # -U only reads: with -r it is a usage error.
        proc = helpers.run([qcowfs, "check", "-U", "-r", "leaks", img], check=False)
        assert proc.returncode == 1 and b"-r" in proc.stderr, proc.stderr
        assert helpers.sha256_file(img) == before
