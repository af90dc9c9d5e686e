"""Host I/O errors injected under a real mount.

Device-mapper (dm-error, dm-flakey) is not available here (no dm_mod), and
LD_PRELOAD would not reach io_uring. Instead the image file is served through
QEMU's blkdebug driver: qemu-storage-daemon exports the image file, unchanged,
as a FUSE file, with blkdebug rules failing reads, writes or flushes (all of
them, or those touching one sector) with EIO. qcowfs then mounts that exported
file as its image, so every failure it sees is a real host I/O error from the
kernel, at exactly the chosen kind of I/O:
  * data read and L2 table load errors: EIO for the affected range only, the
    rest of the disk keeps being served, a transient error is not remembered;
  * data write and flush errors: EIO reaches the writer / fsync caller, other
    ranges stay writable and readable;
and afterwards the image is unchanged by failed reads and passes `qemu-img check`.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qcowfs_testlib import helpers

MiB = 1 << 20
KiB = 1 << 10
EIO = 5


def host_offset(img: Path, guest: int) -> int:
    """Host offset of the data cluster holding guest offset guest (per qemu-img map)."""
    for e in helpers.qemu_img_map(img):
        if e["start"] <= guest < e["start"] + e["length"] and e.get("offset") is not None:
            return e["offset"] + guest - e["start"]
    raise AssertionError(f"guest offset {guest:#x} of {img} is not allocated")


def l2_table_offset(img: Path, guest: int) -> int:
    from qcowfs_testlib import qcow2_meta
    return qcow2_meta.l2_table_offset(img, guest)


@contextlib.contextmanager
def faulty_export(img: Path, workdir: Path, rules: list[dict], writable: bool = False):
    """Exports img through blkdebug as a FUSE file; yields its path.

    rules: blkdebug inject-error rules, e.g. {"event": "read_aio", "sector": 80}
    (errno 5 unless given; once=off unless given).
    """
    exp = workdir / f"exported{img.suffix}"
    exp.touch()
    dbg = ["driver=blkdebug", "node-name=dbg", "image=f"]
    for i, r in enumerate(rules):
        r = {"errno": EIO, **r}
        dbg += [f"inject-error.{i}.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in r.items()]
    args = ["qemu-storage-daemon",
            "--blockdev", f"driver=file,node-name=f,filename={img},cache.direct=off",
            "--blockdev", ",".join(dbg),
            "--blockdev", "driver=raw,node-name=r,file=dbg",
            "--export", f"type=fuse,id=e,node-name=r,mountpoint={exp},writable={'on' if writable else 'off'}"]
    log = workdir / "qsd.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=out, start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not helpers.is_fuse_mounted(exp):
            assert proc.poll() is None, f"qemu-storage-daemon failed: {log.read_text()}"
            assert time.monotonic() < deadline, "qemu-storage-daemon did not export the image"
            time.sleep(0.05)
        yield exp
    finally:
        helpers.unmount(exp)
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            helpers.kill_group(proc.pid)
            proc.wait()


# Runs read/write/fsync steps on a file in a child (a stuck request cannot hang
# the test). Steps: ["r", off, len] -> sha256 or errno; ["w", off, len, byte];
# ["f"] fsync. Prints one JSON result per step.
WORKER = r"""
import hashlib, json, os, sys
path, steps = sys.argv[1], json.loads(sys.argv[2])
fd = os.open(path, os.O_RDWR if any(s[0] in "wf" for s in steps) else os.O_RDONLY)
out = []
for s in steps:
    try:
        if s[0] == "r":
            data = os.pread(fd, s[2], s[1])
            out.append({"sha": hashlib.sha256(data).hexdigest(), "len": len(data)})
        elif s[0] == "w":
            n = os.pwrite(fd, bytes([s[3]]) * s[2], s[1])
            out.append({"written": n})
        else:
            os.fsync(fd)
            out.append({"ok": True})
    except OSError as e:
        out.append({"errno": e.errno})
print(json.dumps(out))
"""


def steps(path: Path, *todo) -> list[dict]:
    proc = subprocess.run([sys.executable, "-c", WORKER, str(path), json.dumps([list(t) for t in todo])],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    return json.loads(proc.stdout)


def sha(data: bytes) -> str:
    import hashlib
    return hashlib.sha256(data).hexdigest()


def pattern(byte: int, n: int) -> str:
    return sha(bytes([byte]) * n)


def qcow2_image(workdir: Path, size: str = "16M", opts: str = "cluster_size=65536") -> Path:
    img = workdir / "img.qcow2"
    helpers.qemu_img("create", "-q", "-f", "qcow2", "-o", opts, img, size)
    helpers.qemu_io(img, "write -q -P 1 0 1M", "write -q -P 2 4M 1M", "write -q -P 3 8M 64k")
    return img


# --------------------------------------------------------------------------
# Reads


def test_data_read_error_fails_only_that_range(workdir):
    img = qcow2_image(workdir)
    bad = host_offset(img, 4 * MiB + 128 * KiB)
    before = helpers.sha256_file(img)
    with faulty_export(img, workdir, [{"event": "read_aio", "sector": bad // 512}]) as exp:
        with helpers.mounted(exp, workdir / "view.raw", ["format=qcow2"]) as m:
            r = steps(m.path, ["r", 4 * MiB + 128 * KiB, 4096], ["r", 4 * MiB, 1 * MiB],
                      ["r", 0, 1 * MiB], ["r", 4 * MiB + 256 * KiB, 64 * KiB], ["r", 8 * MiB, 64 * KiB],
                      ["r", 12 * MiB, 64 * KiB], ["r", 4 * MiB + 128 * KiB, 4096])
            assert r[0] == {"errno": EIO} and r[1] == {"errno": EIO} and r[6] == {"errno": EIO}, r
            assert r[2] == {"sha": pattern(1, MiB), "len": MiB}, r
            assert r[3] == {"sha": pattern(2, 64 * KiB), "len": 64 * KiB}, r
            assert r[4] == {"sha": pattern(3, 64 * KiB), "len": 64 * KiB}, r
            assert r[5] == {"sha": pattern(0, 64 * KiB), "len": 64 * KiB}, r
            assert m.proc.poll() is None
    assert helpers.sha256_file(img) == before
    helpers.qemu_img_check(img)


def test_l2_load_error_fails_that_tables_range_only(workdir):
    # 4 KiB clusters: one L2 table maps 2 MiB, so [4M, 6M) has its own table.
    img = qcow2_image(workdir, opts="cluster_size=4096")
    l2 = l2_table_offset(img, 4 * MiB)
    assert l2 != l2_table_offset(img, 0)
    with faulty_export(img, workdir, [{"event": "read_aio", "sector": l2 // 512}]) as exp:
        with helpers.mounted(exp, workdir / "view.raw", ["format=qcow2"]) as m:
            r = steps(m.path, ["r", 4 * MiB, 4096], ["r", 5 * MiB + 4096, 4096], ["r", 0, 1 * MiB],
                      ["r", 8 * MiB, 64 * KiB], ["r", 4 * MiB, 4096])
            assert r[0] == {"errno": EIO} and r[1] == {"errno": EIO} and r[4] == {"errno": EIO}, r
            assert r[2] == {"sha": pattern(1, MiB), "len": MiB}, r
            assert r[3] == {"sha": pattern(3, 64 * KiB), "len": 64 * KiB}, r
    helpers.qemu_img_check(img)


def test_transient_l2_load_error_is_not_remembered(workdir):
    img = qcow2_image(workdir, opts="cluster_size=4096")
    l2 = l2_table_offset(img, 4 * MiB)
    with faulty_export(img, workdir, [{"event": "read_aio", "sector": l2 // 512, "once": True}]) as exp:
        # cache=none: no kernel readahead on the exported file may consume the one error.
        with helpers.mounted(exp, workdir / "view.raw", ["format=qcow2", "cache=none"]) as m:
            r = steps(m.path, ["r", 4 * MiB, 4096], ["r", 4 * MiB, 4096])
            assert r[0] == {"errno": EIO}, r
            assert r[1] == {"sha": pattern(2, 4096), "len": 4096}, r


def test_open_refused_when_every_host_read_fails(workdir):
    img = qcow2_image(workdir)
    with faulty_export(img, workdir, [{"event": "read_aio"}]) as exp:
        code, text = helpers.mount_fails(exp, workdir / "view.raw", ["format=qcow2"])
        assert "Input/output error" in text, text


# --------------------------------------------------------------------------
# Writes and flushes (raw images: the write path of the raw driver)


def raw_image(workdir: Path) -> Path:
    img = workdir / "img.raw"
    helpers.qemu_img("create", "-q", "-f", "raw", img, "16M")
    helpers.qemu_io(img, "write -q -P 1 0 1M", fmt="raw")
    return img


def test_raw_data_write_error_reaches_the_writer(workdir):
    img = raw_image(workdir)
    with faulty_export(img, workdir, [{"event": "write_aio", "sector": (4 * MiB) // 512}], writable=True) as exp:
        with helpers.mounted(exp, workdir / "view.raw", ["rw", "format=raw"]) as m:
            r = steps(m.path, ["w", 4 * MiB, 4096, 9], ["w", 8 * MiB, 4096, 7], ["f"],
                      ["r", 8 * MiB, 4096], ["r", 0, 4096])
            assert r[0] == {"errno": EIO}, r
            assert r[1] == {"written": 4096} and r[2] == {"ok": True}, r
            assert r[3] == {"sha": pattern(7, 4096), "len": 4096}, r
            assert r[4] == {"sha": pattern(1, 4096), "len": 4096}, r
    with open(img, "rb") as f:
        f.seek(8 * MiB)
        assert f.read(4096) == b"\x07" * 4096


def test_raw_flush_error_reaches_fsync(workdir):
    img = raw_image(workdir)
    # once: an event-armed blkdebug rule otherwise fails every later request, reads included
    # (see test_qcow2_first_read_of_unaffected_data_after_write_error), which made the read
    # below depend on the host page cache. The final flush at unmount then succeeds: exit 0.
    with faulty_export(img, workdir, [{"event": "flush_to_disk", "once": True}], writable=True) as exp:
        with helpers.mounted(exp, workdir / "view.raw", ["rw", "format=raw"], expect_exit=0) as m:
            r = steps(m.path, ["w", 2 * MiB, 4096, 5], ["f"], ["r", 2 * MiB, 4096])
            assert r[0] == {"written": 4096}, r
            assert r[1] == {"errno": EIO}, r
            assert r[2] == {"sha": pattern(5, 4096), "len": 4096}, r


# --------------------------------------------------------------------------
# qcow2 writes: data, metadata write-back, flush


def check_consistent(img: Path) -> dict:
    """qemu-img check: no corruption and no check errors (a failed write may leak clusters)."""
    proc = helpers.run(["qemu-img", "check", "--output=json", "-f", "qcow2", img], check=False)
    report = json.loads(proc.stdout.decode())
    assert report.get("corruptions", 0) == 0 and report.get("check-errors", 0) == 0, report
    return report


def test_qcow2_data_write_error_reaches_writer_and_image_stays_consistent(workdir):
    img = qcow2_image(workdir)
    with faulty_export(img, workdir, [{"event": "write_aio", "once": True}], writable=True) as exp:
        with helpers.mounted(exp, workdir / "view.raw", ["rw", "format=qcow2"], expect_exit=None) as m:
            r = steps(m.path, ["r", 4 * MiB, 64 * KiB], ["w", 12 * MiB, 64 * KiB, 9], ["r", 4 * MiB, 64 * KiB],
                      ["r", 12 * MiB, 4096])
            assert r[0] == {"sha": pattern(2, 64 * KiB), "len": 64 * KiB}, r
            assert r[1] == {"errno": EIO}, r
            assert r[2] == {"sha": pattern(2, 64 * KiB), "len": 64 * KiB}, r  # unaffected data still served
            assert r[3] == {"sha": pattern(0, 4096), "len": 4096}, r  # the failed write left nothing visible
    check_consistent(img)
    assert helpers.convert_to_raw(img, workdir / "after.raw").read_bytes()[12 * MiB: 12 * MiB + 4096] == bytes(4096)


def test_qcow2_metadata_writeback_error_reaches_fsync(workdir):
    # 64 KiB clusters: guest 2M is mapped by the same L2 table as guest 0, so
    # allocating it must rewrite that table, whose sector fails.
    img = qcow2_image(workdir)
    l2 = l2_table_offset(img, 0)
    with faulty_export(img, workdir, [{"event": "write_aio", "sector": l2 // 512}], writable=True) as exp:
        with helpers.mounted(exp, workdir / "view.raw", ["rw", "format=qcow2"], expect_exit=None) as m:
            r = steps(m.path, ["w", 2 * MiB, 64 * KiB, 6], ["f"], ["r", 0, 64 * KiB], ["r", 8 * MiB, 64 * KiB])
            # The L2 update fails either with the write itself or at the write-back fsync forces.
            assert {"errno": EIO} in r[:2], r
            assert r[2] == {"sha": pattern(1, 64 * KiB), "len": 64 * KiB}, r
            assert r[3] == {"sha": pattern(3, 64 * KiB), "len": 64 * KiB}, r
    check_consistent(img)


def test_qcow2_flush_error_reaches_fsync(workdir):
    img = qcow2_image(workdir)
    with faulty_export(img, workdir, [{"event": "flush_to_disk", "once": True}], writable=True) as exp:
        with helpers.mounted(exp, workdir / "view.raw", ["rw", "format=qcow2"], expect_exit=None) as m:
            r = steps(m.path, ["w", 4 * MiB, 4096, 5], ["f"], ["r", 4 * MiB, 4096], ["r", 0, 4096])
            assert r[0] == {"written": 4096}, r
            assert r[1] == {"errno": EIO}, r
            assert r[2] == {"sha": pattern(5, 4096), "len": 4096}, r
            assert r[3] == {"sha": pattern(1, 4096), "len": 4096}, r
    check_consistent(img)


def test_qcow2_first_read_of_unaffected_data_after_write_error(workdir):
    """Data never read before the failed write must still be served afterwards.

    once=on: a blkdebug rule armed by an event fails every later request of any
    kind (reads too) until it is disarmed, so with once=off nothing could be read
    after the first write; measured directly on the export without qcowfs."""
    img = qcow2_image(workdir)
    with faulty_export(img, workdir, [{"event": "write_aio", "once": True}], writable=True) as exp:
        with helpers.mounted(exp, workdir / "view.raw", ["rw", "format=qcow2"], expect_exit=None) as m:
            r = steps(m.path, ["w", 12 * MiB, 64 * KiB, 9], ["r", 4 * MiB, 64 * KiB], ["r", 8 * MiB, 64 * KiB])
            assert r[0] == {"errno": EIO}, r
            assert r[1] == {"sha": pattern(2, 64 * KiB), "len": 64 * KiB}, (r, m.stderr()[-3000:])
            assert r[2] == {"sha": pattern(3, 64 * KiB), "len": 64 * KiB}, (r, m.stderr()[-3000:])
    check_consistent(img)
