"""Persistent dirty bitmaps through a read-write qcow2 mount, with QEMU as the referee.

Bitmaps made by `qemu-img bitmap` are loaded at the first write, updated by
writes, write-zeroes and hole punches through the view, and stored at unmount:
`qemu-img info` must show them consistent (not "in-use"), `qemu-img check`
must find nothing, and QEMU's own reading of each bitmap (qemu-nbd exporting
it, nbdinfo --map=qemu:dirty-bitmap:NAME) must be exactly the granules
written. A disabled bitmap keeps its bits. kill -9 of the daemon after a write
leaves the bitmaps marked in use, as QEMU leaves them, and such a bitmap is
then kept as it is. Hostile directories are in the hostile corpus
(qcowfs_testlib/hostile.py).
"""

from __future__ import annotations

import json
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
    # An inconsistent bitmap is kept as it is by the next read-write mount, as QEMU keeps it.
    with helpers.mounted(img, workdir / "view.raw", ["rw"]) as m:
        dd(m.path, 4 * MiB, 64 * KiB)
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
