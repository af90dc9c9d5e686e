"""A directory of images mounted as a directory of raw views (fuse/catalogue.h):
`qcowfs SRCDIR MOUNTDIR`, one daemon for every image.

QEMU's tools are the referee: every view of a mixed directory (qcow2, two
qcow2 overlays of one shared base, VMDK, VHDX, VDI, raw, qcow2 with LUKS
opened with a key file named in SRCDIR/.qcowfs.conf) reads as `qemu-img
convert -O raw` does; an image made read-write by the options file takes fio
--verify and is clean for `qemu-img check` after unmount. Images added,
removed and renamed while mounted; the lock of an open view refuses qemu-io
writers while qemu-img info still works, and is gone after the idle delay; a
listing opens and locks nothing; a corrupt image, one with a missing backing
file and one with the wrong key fail only their own view, with EIO. Beside
each view, <name>.d/partitions/pN.raw read as the partition's bytes of
`qemu-img convert -O raw` and <name>.d/snapshots/<snap>.raw as `qemu-img
convert -l snapshot.name=<snap>`; listing them opens nothing until
partitions/ or snapshots/ is listed, and an open snapshot view holds its
image's lock until its idle close. Images are a few MiB; the idle delay is 0.3 s, waited for with a 10 s bound
(the machine is loaded)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import struct
import subprocess
import time
from pathlib import Path


from qcowfs_testlib import helpers

MiB = 1 << 20
PASS = "catalogue secret"
SECRET = ["--object", f"secret,id=s0,data={PASS}"]
IDLE = "0.3"
IDLE_BOUND_S = 10.0  # generous: the delay is 0.3 s, the machine is loaded


def qemu_img(*args, env=None) -> None:
    helpers.run(["qemu-img", *args], env=env)


def make_qcow2(path: Path, pattern: int, backing: Path | None = None) -> Path:
    if backing is None:
        qemu_img("create", "-q", "-f", "qcow2", path, "4M")
    else:
        qemu_img("create", "-q", "-f", "qcow2", "-b", backing.name, "-F", "qcow2", path)
    helpers.qemu_io(path, f"write -q -P {pattern} {pattern * 64}k 128k", fmt="qcow2")
    return path


def make_foreign(path: Path, fmt: str, pattern: int) -> Path:
    """A VMDK, VHDX, VDI or raw image with data written by qemu-io."""
    qemu_img("create", "-q", "-f", fmt, path, "4M")
    helpers.qemu_io(path, f"write -q -P {pattern} 1M 192k", f"write -q -P {pattern + 1} 3M 64k", fmt=fmt)
    return path


def make_encrypted(path: Path) -> Path:
    """qcow2 with LUKS encryption (passphrase PASS), a fast KDF, some data."""
    opts = "encrypt.format=luks,encrypt.key-secret=s0,encrypt.iter-time=10,encrypt.hash-alg=sha512"
    for attempt in range(8):  # qemu-img's PBKDF2 calibration may fail to time itself (see test_encryption.py)
        r = helpers.run(["qemu-img", "create", "-q", *SECRET, "-f", "qcow2", "-o", opts, path, "4M"], check=False,
                        env=helpers.fast_kdf_calibration_env())
        if r.returncode == 0:
            break
        assert b"accurate CPU usage" in r.stderr + r.stdout and attempt < 7, r.stderr.decode(errors="replace")
    helpers.run(["qemu-io", *SECRET, "--image-opts", "-c", "write -q -P 7 512k 256k",
                 f"driver=qcow2,encrypt.key-secret=s0,file.filename={path}"])
    return path


def raw_ref(image: Path, out_dir: Path, fmt: str) -> Path:
    out = out_dir / f"{image.name}.ref"
    helpers.convert_to_raw(image, out, fmt=fmt)
    return out


def corrupt_qcow2(path: Path) -> Path:
    """A qcow2 whose L1 table offset is not cluster-aligned (its header probes as qcow2)."""
    qemu_img("create", "-q", "-f", "qcow2", path, "4M")
    with open(path, "r+b") as f:
        f.seek(40)  # l1_table_offset
        f.write(struct.pack(">Q", 0x10001))
    return path


def open_descriptors(pid: int, path: Path) -> int:
    """How many of the process's file descriptors are open on path."""
    fd_dir = Path(f"/proc/{pid}/fd")
    count = 0
    for fd in fd_dir.iterdir():
        try:
            count += os.readlink(fd) == str(path)
        except OSError:
            pass
    return count


def open_error(view: Path) -> int:
    try:
        with open(view, "rb") as f:
            f.read(4096)
    except OSError as e:
        return e.errno
    return 0


def qemu_io_write(image: Path, fmt: str = "qcow2", offset: int = 0) -> subprocess.CompletedProcess:
    """qemu-io opening image read-write (as a VM would) and writing zeros where it reads as zeros."""
    return helpers.run(["qemu-io", "-f", fmt, "-c", f"write -P 0 {offset} 4k", image], check=False, timeout=60)


def with_dirs(*views: str) -> list[str]:
    """A catalogue listing: each <name>.raw view with its <name>.d beside it, sorted."""
    return sorted([*views, *(v[:-len(".raw")] + ".d" for v in views if v.endswith(".raw"))])


def lock_refused(proc: subprocess.CompletedProcess) -> bool:
    return 'Failed to get "write" lock' in (proc.stdout + proc.stderr).decode(errors="replace")


def test_mixed_directory_reads_like_qemu_and_fails_alone(workdir):
    src, refs, mnt = workdir / "src", workdir / "refs", workdir / "mnt"
    for d in (src, refs, mnt, src / "sub"):
        d.mkdir()
    base = make_qcow2(src / "base.qcow2", 1)
    images = {
        "base.raw": (base, "qcow2"),
        "vm1.raw": (make_qcow2(src / "vm1.qcow2", 2, backing=base), "qcow2"),
        "vm2.raw": (make_qcow2(src / "vm2.qcow2", 3, backing=base), "qcow2"),
        "disk.raw": (make_foreign(src / "disk.vmdk", "vmdk", 4), "vmdk"),
        "win.raw": (make_foreign(src / "win.vhdx", "vhdx", 6), "vhdx"),
        "vbox.raw": (make_foreign(src / "vbox.vdi", "vdi", 8), "vdi"),
        "sub/plain.raw": (make_foreign(src / "sub" / "plain.img", "raw", 10), "raw"),
    }
    enc = make_encrypted(src / "enc.qcow2")
    os.link(enc, src / "enc-wrongkey.qcow2")
    (workdir / "pass.txt").write_text(PASS)
    (workdir / "wrong.txt").write_text("not the passphrase")
    (src / ".qcowfs.conf").write_text(
        "# per-image options\n"
        f"enc.qcow2 key-file={workdir / 'pass.txt'}\n"
        f"enc-wrongkey.qcow2 key-file={workdir / 'wrong.txt'}\n")
    corrupt_qcow2(src / "corrupt.qcow2")
    make_qcow2(src / "orphan.qcow2", 5, backing=make_qcow2(src / "gone.qcow2", 4))
    (src / "gone.qcow2").unlink()
    (src / "notes.txt").write_text("not a disk image\n")
    refs_by_view = {v: raw_ref(p, refs, f) for v, (p, f) in images.items()}
    enc_ref = refs / "enc.ref"
    helpers.run(["qemu-img", "convert", *SECRET, "--image-opts",
                 f"driver=qcow2,encrypt.key-secret=s0,file.filename={enc}", "-O", "raw", enc_ref])
    refs_by_view["enc.raw"] = enc_ref

    with helpers.mounted(src, mnt) as m:
        assert sorted(os.listdir(mnt)) == with_dirs(
            "base.raw", "vm1.raw", "vm2.raw", "disk.raw", "win.raw", "vbox.raw", "enc.raw", "enc-wrongkey.raw",
            "corrupt.raw", "orphan.raw", "sub")
        assert sorted(os.listdir(mnt / "sub")) == with_dirs("plain.raw")
        # Listing (and stat) opened nothing: no image is locked.
        for view, ref in refs_by_view.items():
            assert (mnt / view).stat().st_size == ref.stat().st_size, view
        proc = qemu_io_write(src / "disk.vmdk", "vmdk")
        assert proc.returncode == 0 and not lock_refused(proc), proc.stderr.decode(errors="replace")
        # Two overlays open at once share one opened base: the daemon holds base.qcow2 open as often
        # as one overlay's own file (once; each opened file has two descriptors), not once per overlay.
        with open(mnt / "vm1.raw", "rb") as f1, open(mnt / "vm2.raw", "rb") as f2:
            assert f1.read(4096) == refs_by_view["vm1.raw"].read_bytes()[:4096]
            assert f2.read(4096) == refs_by_view["vm2.raw"].read_bytes()[:4096]
            per_image = open_descriptors(m.proc.pid, src / "vm1.qcow2")
            assert per_image >= 1
            assert open_descriptors(m.proc.pid, src / "vm2.qcow2") == per_image
            assert open_descriptors(m.proc.pid, base) == per_image
        for view, ref in refs_by_view.items():
            assert helpers.files_equal(mnt / view, ref), f"{view} differs from qemu-img convert"
        # One broken image fails its own open (EIO, the reason logged), nothing else.
        for view, name in [("corrupt.raw", "corrupt.qcow2"), ("orphan.raw", "gone.qcow2"),
                           ("enc-wrongkey.raw", "enc-wrongkey.qcow2")]:
            assert open_error(mnt / view) == errno.EIO, view
            assert name in m.stderr(), m.stderr()
        assert helpers.files_equal(mnt / "vm1.raw", refs_by_view["vm1.raw"])


def test_live_directory_lock_idle_close_and_rw(workdir):
    src, mnt = workdir / "src", workdir / "mnt"
    src.mkdir()
    mnt.mkdir()
    ro = make_qcow2(src / "ro.qcow2", 1)
    rw = make_qcow2(src / "rw.qcow2", 2)
    (src / ".qcowfs.conf").write_text("rw.* rw,cache=none\n")
    (workdir / "before").mkdir()
    (workdir / "after").mkdir()
    expected = raw_ref(rw, workdir / "before", "qcow2")
    ro_ref = raw_ref(ro, workdir / "before", "qcow2")

    with helpers.mounted(src, mnt, [f"idle-timeout={IDLE}"]) as m:
        assert sorted(os.listdir(mnt)) == with_dirs("ro.raw", "rw.raw")
        # An open read-only view: readers share it, writers are refused by the lock.
        with open(mnt / "ro.raw", "rb") as f:
            assert f.read(4096) == ro_ref.read_bytes()[:4096]
            helpers.qemu_img_info(ro, fmt="qcow2")
            assert lock_refused(qemu_io_write(ro))
            # Renamed away while open: the open view keeps reading; the listing follows the rename.
            os.rename(ro, src / "moved.qcow2")
            f.seek(128 * 1024)
            assert f.read(64 * 1024) == ro_ref.read_bytes()[128 * 1024:192 * 1024]
            assert sorted(os.listdir(mnt)) == with_dirs("moved.raw", "rw.raw")
        # After the idle delay the image is closed: the lock is gone.
        deadline = time.monotonic() + IDLE_BOUND_S
        while lock_refused(proc := qemu_io_write(src / "moved.qcow2")) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.returncode == 0 and not lock_refused(proc), proc.stderr.decode(errors="replace")

        # Added and removed while mounted.
        shutil.copy(src / "moved.qcow2", src / "new.qcow2")
        assert (mnt / "new.raw").stat().st_size == 4 * MiB
        assert "new.raw" in os.listdir(mnt)
        (src / "new.qcow2").unlink()
        assert not (mnt / "new.raw").exists()
        assert sorted(os.listdir(mnt)) == with_dirs("moved.raw", "rw.raw")

        # The read-write image (from .qcowfs.conf): fio writes and verifies.
        assert os.stat(mnt / "moved.raw").st_mode & 0o222 == 0
        helpers.run(["fio", "--name=cat", f"--filename={mnt / 'rw.raw'}", "--rw=randwrite", "--bs=4k",
                     "--size=1M", "--offset=2M", "--direct=1", "--ioengine=psync", "--verify=crc32c",
                     "--randseed=7", "--output-format=terse"], timeout=120)
        with open(mnt / "rw.raw", "r+b") as f:
            f.seek(2 * MiB)
            written = f.read(MiB)
        assert m.proc.poll() is None
    helpers.qemu_img_check(rw)
    after = raw_ref(rw, workdir / "after", "qcow2")
    data = bytearray(expected.read_bytes())
    data[2 * MiB:3 * MiB] = written
    assert after.read_bytes() == bytes(data)


def test_bad_options_file_is_refused_at_mount(workdir):
    src, mnt = workdir / "src", workdir / "mnt"
    src.mkdir()
    mnt.mkdir()
    (src / ".qcowfs.conf").write_text("*.qcow2 rw\n*.vmdk writeback=yes\n")
    code, text = helpers.mount_fails(src, mnt)
    assert ".qcowfs.conf:2" in text and "writeback=yes" in text, text


def partition_layout(disk: Path) -> dict[int, tuple[int, int]]:
    """{partition number: (offset, size)} as sfdisk reads them."""
    table = json.loads(helpers.run(["sfdisk", "-J", disk]).stdout)["partitiontable"]
    return {int(p["node"].rsplit(disk.name, 1)[1].lstrip("p")): (p["start"] * 512, p["size"] * 512)
            for p in table["partitions"]}


def test_partitions_and_snapshots_beside_each_view(workdir):
    src, mnt = workdir / "src", workdir / "mnt"
    src.mkdir()
    mnt.mkdir()
    # An MBR-partitioned disk made as a raw file, converted to qcow2; snapshot s1, then the
    # current state made to differ from it.
    raw = workdir / "parted.img"
    qemu_img("create", "-q", "-f", "raw", raw, "8M")
    helpers.run(["sfdisk", "-q", "--no-reread", "--no-tell-kernel", raw], input=b"label: dos\n2048,4096,L\n,,L\n")
    layout = partition_layout(raw)
    assert sorted(layout) == [1, 2]
    helpers.qemu_io(raw, "write -q -P 0x11 1M 64k", "write -q -P 0x22 3M 64k", fmt="raw")
    disk = src / "disk.qcow2"
    qemu_img("convert", "-f", "raw", "-O", "qcow2", raw, disk)
    qemu_img("snapshot", "-c", "s1", disk)
    helpers.qemu_io(disk, "write -q -P 0x33 1M 64k", fmt="qcow2")
    make_qcow2(src / "plain.qcow2", 2)
    corrupt_qcow2(src / "corrupt.qcow2")
    (src / ".qcowfs.conf").write_text("disk.qcow2 rw\n")
    full = helpers.convert_to_raw(disk, workdir / "disk.ref", fmt="qcow2").read_bytes()
    s1 = helpers.convert_to_raw(disk, workdir / "s1.ref", fmt="qcow2", snapshot="s1")
    assert s1.read_bytes() != full  # the snapshot view must not pass by showing the current disk
    part = mnt / "disk.d" / "partitions"
    snap = mnt / "disk.d" / "snapshots" / "s1.raw"

    with helpers.mounted(src, mnt, [f"idle-timeout={IDLE}"]) as m:
        assert sorted(os.listdir(mnt)) == with_dirs("corrupt.raw", "disk.raw", "plain.raw")
        assert sorted(os.listdir(mnt / "disk.d")) == ["partitions", "snapshots"]  # s1 is in the header
        assert os.listdir(mnt / "plain.d") == ["partitions"]
        assert stat.S_ISDIR(os.stat(mnt / "disk.d").st_mode)
        assert "corrupt.qcow2" not in m.stderr(), m.stderr()
        # Listing MOUNTDIR and <name>.d opened nothing: no lock is held (zeros written over zeros).
        proc = qemu_io_write(disk, offset=6 * MiB)
        assert proc.returncode == 0 and not lock_refused(proc), proc.stderr.decode(errors="replace")

        assert sorted(os.listdir(part)) == ["p1.raw", "p2.raw"]
        assert os.listdir(mnt / "plain.d" / "partitions") == []
        assert os.listdir(mnt / "corrupt.d" / "partitions") == []  # its failure is its own
        assert "corrupt.qcow2" in m.stderr(), m.stderr()
        for n, (offset, size) in layout.items():
            assert (part / f"p{n}.raw").stat().st_size == size
            with open(part / f"p{n}.raw", "rb") as f:
                assert f.read() == full[offset:offset + size], f"p{n}.raw differs from qemu-img convert"
        assert os.listdir(mnt / "disk.d" / "snapshots") == ["s1.raw"]
        assert helpers.files_equal(snap, s1)
        # A snapshot is read-only in a read-write image; its partitions follow the image.
        assert os.stat(snap).st_mode & 0o222 == 0 and os.stat(part / "p1.raw").st_mode & 0o200
        try:
            open(snap, "r+b").close()
            raise AssertionError("a snapshot view opened for writing")
        except OSError as e:
            assert e.errno == errno.EROFS, e
        # chmod/chown of a view as directory mode allows it; its <name>.d follows; others refuse.
        os.chmod(mnt / "disk.raw", 0o600)
        os.listdir(mnt)  # a re-read keeps it: the image file's own mode did not change
        assert os.stat(mnt / "disk.raw").st_mode & 0o777 == 0o600
        assert os.stat(part / "p1.raw").st_mode & 0o777 == 0o600
        try:
            os.chmod(part / "p1.raw", 0o644)
            raise AssertionError("chmod of a partition view succeeded")
        except OSError as e:
            assert e.errno == errno.EPERM, e

        # A write through a partition view lands at the partition's offset of the image.
        offset2 = layout[2][0]
        with open(part / "p2.raw", "r+b") as f:
            f.seek(128 * 1024)
            f.write(b"\x5a" * 4096)
        # An open snapshot view holds its image (locked); after its idle close and the image's,
        # the lock is gone.
        with open(snap, "rb") as f:
            assert f.read(4096) == s1.read_bytes()[:4096]
            assert lock_refused(qemu_io_write(disk, offset=6 * MiB))
        deadline = time.monotonic() + IDLE_BOUND_S
        while lock_refused(proc := qemu_io_write(disk, offset=6 * MiB)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.returncode == 0 and not lock_refused(proc), proc.stderr.decode(errors="replace")
    helpers.qemu_img_check(disk)
    after = helpers.convert_to_raw(disk, workdir / "after.ref", fmt="qcow2").read_bytes()
    expected = bytearray(full)
    expected[offset2 + 128 * 1024:offset2 + 132 * 1024] = b"\x5a" * 4096
    assert after == bytes(expected)
