"""Persistent dirty bitmaps through a read-write qcow2 mount, with QEMU as the referee.

Bitmaps made by `qemu-img bitmap` are loaded at the first write, updated by
writes, write-zeroes and hole punches through the view, and stored at unmount:
`qemu-img info` must show them consistent (not "in-use"), `qemu-img check`
must find nothing, and QEMU's own reading of each bitmap (qemu-nbd exporting
it, nbdinfo --map=qemu:dirty-bitmap:NAME) must be exactly the granules
written. A disabled bitmap keeps its bits. kill -9 of the daemon after a write
leaves the bitmaps marked in use, as QEMU leaves them, and such a bitmap is
then kept as it is, and left out of DIR/bitmaps/. In directory mode
DIR/bitmaps/NAME.raw shows a bitmap: its SEEK_DATA ranges are QEMU's dirty
clusters, live in a rw mount, also in a read-only one, and a sparse copy of
it restores the disk over the full copy taken when the bitmap was added.
Hostile directories are in the hostile corpus (qcowfs_testlib/hostile.py).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from qcowfs_testlib import helpers

KiB, MiB = 1 << 10, 1 << 20
SIZE = 16 * MiB
NBD_START_TIMEOUT_S = 20  # qemu-nbd starts in well under a second; generous for a loaded machine


def merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for off, length in sorted(ranges):
        if out and out[-1][0] + out[-1][1] >= off:
            end = max(out[-1][0] + out[-1][1], off + length)
            out[-1] = (out[-1][0], end - out[-1][0])
        else:
            out.append((off, length))
    return out


def granules(ranges: list[tuple[int, int]], g: int) -> list[tuple[int, int]]:
    """The granule-aligned ranges a bitmap of granularity g marks for these writes."""
    out = []
    for off, length in ranges:
        start, end = off // g * g, min(SIZE, -(-(off + length) // g) * g)
        out.append((start, end - start))
    return merge(out)


def qemu_dirty(img: Path, name: str, workdir: Path) -> list[tuple[int, int]]:
    """QEMU's view of bitmap `name`: qemu-nbd exports it, nbdinfo maps the context."""
    sock = workdir / f"nbd-{img.stem}-{name}.sock"
    sock.unlink(missing_ok=True)  # a killed qemu-nbd leaves its socket behind
    nbd = subprocess.Popen(["qemu-nbd", "-r", "-f", "qcow2", "-k", str(sock), "-B", name, str(img)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + NBD_START_TIMEOUT_S
        while not sock.exists():
            assert nbd.poll() is None, f"qemu-nbd failed: {nbd.stderr.read().decode() if nbd.stderr else ''}"
            assert time.monotonic() < deadline, "qemu-nbd did not create its socket"
            time.sleep(0.02)
        out = helpers.run(["nbdinfo", f"--map=qemu:dirty-bitmap:{name}",
                           f"nbd+unix:///?socket={sock}"]).stdout.decode()
    finally:
        nbd.kill()
        nbd.wait()
    dirty = []
    for line in out.splitlines():
        off, length, kind = (int(x) for x in line.split()[:3])
        if kind & 1:
            dirty.append((off, length))
    return merge(dirty)


def bitmap_flags(img: Path, *opts: str) -> dict[str, list[str]]:
    info = json.loads(helpers.qemu_img("info", "--output=json", "-f", "qcow2", *opts, img))
    return {b["name"]: b["flags"] for b in info["format-specific"]["data"].get("bitmaps", [])}


def assert_info_matches(img: Path) -> None:
    """qcowfs info lists the bitmaps as qemu-img info does (text and JSON)."""
    def specific(text: str) -> str:
        return text[text.index("Format specific information:"):]
    ours = helpers.run([helpers.qcowfs_bin(), "info", str(img)]).stdout.decode()
    assert specific(ours) == specific(helpers.qemu_img("info", img))
    ours_json = json.loads(helpers.run([helpers.qcowfs_bin(), "info", "--output=json", str(img)]).stdout)
    assert ours_json["format-specific"] == helpers.qemu_img_info(img)["format-specific"]


def dd(view: Path, off: int, length: int) -> None:
    helpers.run(["dd", "if=/dev/urandom", f"of={view}", "bs=4k", f"seek={off // 4096}", f"count={length // 4096}",
                 "oflag=direct", "conv=notrunc,fsync", "status=none"])


def make_image(workdir: Path) -> Path:
    """b0 (64k, enabled), b1 (128k, enabled) clean; d0 disabled with bits at 1M."""
    img = workdir / "bm.qcow2"
    helpers.qemu_img("create", "-q", "-f", "qcow2", img, str(SIZE))
    helpers.qemu_img("bitmap", "--add", img, "b0")
    helpers.qemu_img("bitmap", "--add", "-g", "128k", img, "b1")
    helpers.qemu_img("bitmap", "--add", img, "d0")
    helpers.qemu_io(img, "write -P 3 1M 64k")
    helpers.qemu_img("bitmap", "--disable", img, "d0")
    helpers.qemu_img("bitmap", "--clear", img, "b0")
    helpers.qemu_img("bitmap", "--clear", img, "b1")
    return img


def test_writes_zeroes_and_discards_set_bits(workdir: Path):
    img = make_image(workdir)
    assert qemu_dirty(img, "d0", workdir) == [(1 * MiB, 64 * KiB)]
    writes = [(2 * MiB, 64 * KiB), (5 * MiB + 4 * KiB, 4 * KiB), (8 * MiB, 256 * KiB), (12 * MiB, 64 * KiB),
              (SIZE - 4 * KiB, 4 * KiB)]
    with helpers.mounted(img, workdir / "view.raw", ["rw"]) as m:
        dd(m.path, *writes[0])
        dd(m.path, *writes[1])
        helpers.run(["fallocate", "-p", "-o", str(writes[2][0]), "-l", str(writes[2][1]), str(m.path)])
        helpers.run(["fallocate", "-z", "-o", str(writes[3][0]), "-l", str(writes[3][1]), str(m.path)])
        dd(m.path, *writes[4])
        assert "in-use" in bitmap_flags(img, "-U")["b0"], "IN_USE must be on disk while the mount writes"
    assert bitmap_flags(img) == {"b0": ["auto"], "b1": ["auto"], "d0": []}
    assert_info_matches(img)
    helpers.qemu_img_check(img)
    assert qemu_dirty(img, "b0", workdir) == granules(writes, 64 * KiB)
    assert qemu_dirty(img, "b1", workdir) == granules(writes, 128 * KiB)
    assert qemu_dirty(img, "d0", workdir) == [(1 * MiB, 64 * KiB)], "a disabled bitmap keeps its bits"


def test_kill9_leaves_bitmaps_in_use(workdir: Path):
    img = make_image(workdir)
    with helpers.mounted(img, workdir / "view.raw", ["rw"], expect_exit=None) as m:
        dd(m.path, 3 * MiB, 64 * KiB)
        helpers.kill_group(m.proc.pid)
        m.proc.wait()
    flags = bitmap_flags(img)
    assert flags == {"b0": ["in-use", "auto"], "b1": ["in-use", "auto"], "d0": ["in-use"]}, flags
    assert_info_matches(img)
    # An inconsistent bitmap is kept as it is by the next read-write mount, as QEMU keeps it,
    # and not shown as a file (qemu-nbd -B refuses to export it).
    mnt = workdir / "dir"
    mnt.mkdir()
    with helpers.mounted(img, mnt, ["rw"]) as m:
        dd(m.path, 4 * MiB, 64 * KiB)
        assert not (mnt / "bitmaps").exists(), os.listdir(mnt)
        assert "bitmap 'b0' is inconsistent" in m.stderr(), m.stderr()
    assert bitmap_flags(img) == flags
    # QEMU refuses to resize an image with an inconsistent bitmap; so does qcowfs.
    twin = workdir / "twin.qcow2"
    shutil.copy(img, twin)
    theirs = helpers.run(["qemu-img", "resize", str(twin), "+1M"], check=False)
    ours = helpers.run([helpers.qcowfs_bin(), "resize", str(img), "+1M"], check=False)
    assert theirs.returncode == ours.returncode == 1, (theirs, ours)
    for proc in (theirs, ours):
        assert b"Bitmap 'b0' is inconsistent and cannot be used" in proc.stderr, proc.stderr
    proc = helpers.run(["qemu-img", "check", "--output=json", str(img)], check=False)
    report = json.loads(proc.stdout)  # leaks are allowed after kill -9, nothing worse
    assert report.get("corruptions", 0) == 0 and report.get("check-errors", 0) == 0, report
    # Removing an inconsistent bitmap frees its table and data clusters, as qemu-img's removal does.
    helpers.run(["qemu-img", "check", "-q", "-r", "leaks", str(img)])  # start both from a clean image
    shutil.copy(img, twin)
    assert bitmap_cmd("qemu-img", twin, "--remove", "b0") == bitmap_cmd("qcowfs", img, "--remove", "b0") == (0, "")
    for image in (twin, img):
        helpers.qemu_img_check(image)
    assert bitmap_flags(img) == bitmap_flags(twin) == {"b1": ["in-use", "auto"], "d0": ["in-use"]}


def bitmap_cmd(tool: str, img: Path, *args: str) -> tuple[int, str]:
    """`TOOL bitmap ARGS... IMG BITMAP` (the last arg is the bitmap): exit code and the error after the prefix."""
    argv = ["qemu-img"] if tool == "qemu-img" else [helpers.qcowfs_bin()]
    proc = helpers.run([*argv, "bitmap", *args[:-1], str(img), args[-1]], check=False)
    err = proc.stderr.decode().strip()
    for prefix in ("qemu-img: ", "qcowfs bitmap: "):
        err = err.removeprefix(prefix)
    return proc.returncode, err


def test_bitmap_command_matches_qemu_img(workdir: Path):
    """The same operations by qcowfs bitmap and qemu-img bitmap on twin images: same bitmaps, flags and bits."""
    twins = {}
    for tool in ("qemu-img", "qcowfs"):
        img = workdir / f"{tool}.qcow2"
        helpers.qemu_img("create", "-q", "-f", "qcow2", img, str(SIZE))
        twins[tool] = img
    steps = [["--add", "b0"], ["--add", "-g", "128k", "b1"], ["--add", "--disable", "b2"], "write",
             ["--disable", "b1"], ["--merge", "b0", "b2"], ["--clear", "b0"], ["--add", "gone"], ["--remove", "gone"],
             ["--add", "b0"], ["--remove", "nosuch"], ["--enable", "nosuch"], ["--add", "-g", "1000", "bad"]]
    for step in steps:
        if step == "write":
            for img in twins.values():
                helpers.qemu_io(img, "write -P 1 1M 64k", "write -P 2 9M 4k")
            continue
        results = {tool: bitmap_cmd(tool, img, *step) for tool, img in twins.items()}
        assert results["qcowfs"] == results["qemu-img"], (step, results)
    for tool, img in twins.items():  # the bitmaps follow a resize (stored with the new size)
        argv = ["qemu-img"] if tool == "qemu-img" else [helpers.qcowfs_bin()]
        helpers.run([*argv, "resize", str(img), "+8M"])
    infos = {tool: bitmap_flags(img) for tool, img in twins.items()}
    assert infos["qcowfs"] == infos["qemu-img"] == {"b0": ["auto"], "b1": [], "b2": []}, infos
    for name in ("b0", "b1", "b2"):
        dirty = {tool: qemu_dirty(img, name, workdir) for tool, img in twins.items()}
        assert dirty["qcowfs"] == dirty["qemu-img"], (name, dirty)
    assert qemu_dirty(twins["qcowfs"], "b2", workdir) == [(1 * MiB, 64 * KiB), (9 * MiB, 64 * KiB)]
    helpers.qemu_img_check(twins["qcowfs"])


def apply_data_ranges(inc: Path, full: Path) -> None:
    """Writes inc's SEEK_DATA ranges over full at the same offsets (the restore of an incremental backup)."""
    with open(inc, "rb") as src, open(full, "r+b") as dst:
        for start, end in helpers.data_extents(inc):
            src.seek(start)
            dst.seek(start)
            dst.write(src.read(end - start))


def as_extents(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    return [(off, off + length) for off, length in ranges]


# README's copy_data: SRC's data ranges (qemu-img map) copied with dd at the same offsets of DST.
COPY_DATA = r"""
copy_data() {
  qemu-img map -f raw "$1" | tail -n +2 | while read -r off len _; do
    dd if="$1" of="$2" bs=1M iflag=skip_bytes,count_bytes oflag=seek_bytes conv=notrunc status=none \
       skip=$((off)) seek=$((off)) count=$((len))
  done
}
"""


def copy_data(src: Path, dst: Path) -> None:
    helpers.run(["bash", "-ec", "set -o pipefail" + COPY_DATA + 'copy_data "$0" "$1"', src, dst])


def test_bitmap_files_are_incremental_backups(workdir: Path):
    """bitmaps/b0.raw: data where b0 is dirty (QEMU's clusters), the disk's bytes there, zeros elsewhere."""
    img = workdir / "inc.qcow2"
    helpers.qemu_img("create", "-q", "-f", "qcow2", img, str(SIZE))
    # Data before the bitmap (every dirty cluster below holds some; one is zeroed later).
    helpers.qemu_io(img, "write -P 7 0 4M", "write -P 7 15M 1M")
    helpers.qemu_img("bitmap", "--add", img, "b0")
    full = helpers.convert_to_raw(img, workdir / "full.raw")  # the full backup the bitmap counts from
    writes = [(1 * MiB + 100, 5000, 0x11), (3 * MiB - 7, 70 * KiB, 0x22), (9 * MiB, 64 * KiB, 0x33),
              (SIZE - 10, 10, 0x44)]
    zeroed = (2 * MiB, 64 * KiB)  # all 7s in the full copy, all zeros now: a dirty cluster that reads as zeros
    expected = granules([(off, length) for off, length, _ in writes] + [zeroed], 64 * KiB)
    inc, inc_always = workdir / "inc.raw", workdir / "inc-always.raw"
    mnt = workdir / "dir"
    mnt.mkdir()
    with helpers.mounted(img, mnt, ["rw"]) as m:
        view = mnt / "bitmaps" / "b0.raw"
        assert helpers.data_extents(view) == [], "nothing written yet"
        fd = os.open(m.path, os.O_WRONLY)
        try:
            for off, length, byte in writes:
                assert os.pwrite(fd, bytes([byte]) * length, off) == length
            os.fsync(fd)
        finally:
            os.close(fd)
        helpers.run(["fallocate", "-z", "-o", str(zeroed[0]), "-l", str(zeroed[1]), str(m.path)])
        st = os.stat(view)
        assert st.st_size == SIZE and st.st_mode & 0o222 == 0, st
        try:
            os.close(os.open(view, os.O_WRONLY))
            raise AssertionError("a bitmap file opened for writing")
        except OSError as e:
            assert e.errno in (errno.EROFS, errno.EACCES), e
        live = helpers.data_extents(view)  # the live bitmap: the writes above are in it
        assert live == as_extents(expected), (live, expected)
        disk, shown = m.path.read_bytes(), view.read_bytes()
        pos = 0
        for start, end in live:
            assert shown[pos:start] == bytes(start - pos), f"non-zero bytes in the clean range [{pos}, {start})"
            assert shown[start:end] == disk[start:end], f"the dirty range [{start}, {end}) is not the disk's"
            pos = end
        assert shown[pos:] == bytes(SIZE - pos)
        with open(inc, "wb") as f:
            f.truncate(SIZE)
        copy_data(view, inc)  # README's backup
        helpers.run(["cp", "--sparse=always", str(view), str(inc_always)])
    assert qemu_dirty(img, "b0", workdir) == expected, "QEMU's dirty clusters differ from the file's data ranges"
    current = helpers.convert_to_raw(img, workdir / "current.raw")
    assert helpers.data_extents(inc) == as_extents(expected)
    restored = workdir / "restored.raw"
    shutil.copy(full, restored)
    copy_data(inc, restored)  # README's restore
    assert helpers.files_equal(restored, current), "the increment over the full copy is not the disk"
    # cp --sparse=always keeps every dirty cluster but the zeroed one (README says so): a restore from
    # it differs from the disk exactly there.
    assert helpers.data_extents(inc_always) == [
        r for r in as_extents(expected) if r != (zeroed[0], zeroed[0] + zeroed[1])]
    shutil.copy(full, restored)
    apply_data_ranges(inc_always, restored)
    got, want = restored.read_bytes(), current.read_bytes()
    z0, z1 = zeroed[0], zeroed[0] + zeroed[1]
    assert got[:z0] == want[:z0] and got[z1:] == want[z1:]
    assert got[z0:z1] == b"\x07" * zeroed[1] and want[z0:z1] == bytes(zeroed[1])
    # A read-only mount shows the same bitmap file (the bitmaps are loaded read-only).
    with helpers.mounted(img, mnt) as m:
        view = mnt / "bitmaps" / "b0.raw"
        assert os.stat(view).st_blocks * 512 == sum(length for _, length in expected)  # the dirty bytes
        assert helpers.data_extents(view) == as_extents(expected)
        assert helpers.files_equal(view, inc)


def test_fio_writes_then_a_cp_sparse_always_backup_restores_the_disk(workdir: Path):
    """The issue's acceptance as written: qemu-img bitmap --add, fio writes at known offsets through a rw
    mount, `cp --sparse=always` of DIR/bitmaps/b0.raw; after unmount QEMU reads the bitmap consistent with
    exactly the clusters fio wrote, and that copy applied over the full copy taken at --add is the disk."""
    img = workdir / "fio.qcow2"
    helpers.qemu_img("create", "-q", "-f", "qcow2", img, str(SIZE))
    helpers.qemu_io(img, "write -P 5 0 16M")  # the whole disk holds data before the bitmap
    helpers.qemu_img("bitmap", "--add", img, "b0")
    full = helpers.convert_to_raw(img, workdir / "full.raw")
    # (offset, size, fio job): random 4k writes cover the whole range (fio's random map visits each
    # block once), sequential 64k ones too; the offsets straddle granules on purpose.
    jobs = [(1 * MiB + 4 * KiB, 120 * KiB, "--rw=randwrite --bs=4k"),
            (5 * MiB - 64 * KiB, 192 * KiB, "--rw=write --bs=64k"),
            (11 * MiB + 68 * KiB, 8 * KiB, "--rw=randwrite --bs=4k"),
            (SIZE - 256 * KiB, 256 * KiB, "--rw=write --bs=128k --iodepth=4")]
    expected = granules([(off, size) for off, size, _ in jobs], 64 * KiB)
    mnt, inc = workdir / "dir", workdir / "inc.raw"
    mnt.mkdir()
    with helpers.mounted(img, mnt, ["rw"]) as m:
        for i, (off, size, rw) in enumerate(jobs):
            helpers.run(["fio", f"--name=w{i}", f"--filename={m.path}", "--direct=1", "--ioengine=io_uring",
                         f"--offset={off}", f"--size={size}", "--refill_buffers", "--randrepeat=0",
                         "--end_fsync=1", *rw.split()])
        view = mnt / "bitmaps" / "b0.raw"
        assert helpers.data_extents(view) == as_extents(expected)
        helpers.run(["cp", "--sparse=always", str(view), str(inc)])
    assert bitmap_flags(img) == {"b0": ["auto"]}, "not stored consistent at unmount"
    assert qemu_dirty(img, "b0", workdir) == expected, "QEMU's dirty clusters are not the ones fio wrote"
    helpers.qemu_img_check(img)
    assert helpers.data_extents(inc) == as_extents(expected), "cp --sparse=always lost a dirty range"
    restored = workdir / "restored.raw"
    shutil.copy(full, restored)
    apply_data_ranges(inc, restored)
    current = helpers.convert_to_raw(img, workdir / "current.raw")
    assert full.read_bytes() != current.read_bytes(), "fio wrote nothing"
    assert helpers.files_equal(restored, current), "the increment over the full copy is not the disk"


def test_bitmap_command_takes_a_key_file(workdir: Path):
    """qcowfs bitmap on an encrypted qcow2 with --key-file, as info, map and resize take the passphrase."""
    key = workdir / "pass.txt"
    key.write_text("bitmap secret")
    img = workdir / "enc.qcow2"
    secret = ["--object", f"secret,id=s0,file={key}"]
    for attempt in range(8):  # qemu-img's PBKDF2 calibration may fail on a too-fast clock tick (test_encryption.py)
        made = helpers.run(["qemu-img", "create", "-q", *secret, "-f", "qcow2", "-o",
                            "encrypt.format=luks,encrypt.key-secret=s0,encrypt.iter-time=10,encrypt.hash-alg=sha512",
                            str(img), str(4 * MiB)], check=False, env=helpers.fast_kdf_calibration_env())
        if made.returncode == 0 or b"accurate CPU usage" not in made.stderr or attempt == 7:
            break
    assert made.returncode == 0, made
    refused = helpers.run([helpers.qcowfs_bin(), "bitmap", "--add", str(img), "b0"], check=False, input=b"")
    assert refused.returncode == 1 and bitmap_flags(img) == {}, refused  # no terminal to ask
    assert b"give its passphrase with --key-file PATH" in refused.stderr, refused  # the tool's option
    helpers.run([helpers.qcowfs_bin(), "bitmap", "--add", "--key-file", str(key), str(img), "b0"])
    assert bitmap_flags(img) == {"b0": ["auto"]}
    check = helpers.run(["qemu-img", "check", "--output=json", *secret, "--image-opts",
                         f"driver=qcow2,encrypt.key-secret=s0,file.filename={img}"])
    report = json.loads(check.stdout)
    assert all(report.get(k, 0) == 0 for k in ("corruptions", "leaks", "check-errors")), report
