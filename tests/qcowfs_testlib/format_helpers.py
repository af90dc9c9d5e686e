"""What every read-only format test checks, with QEMU as the referee.

A format's test file (test_format_FMT.py) makes images with `make_image()` (or
its own qemu-img/qemu-io recipe) and hands them to `check_image()`, which
mounts the image read-only and checks, against qemu-img on the same image:

  * the view's bytes equal `qemu-img convert -O raw` (whole file, compared
    with reads of several sizes, including unaligned ones);
  * SEEK_DATA/SEEK_HOLE agree with `qemu-img map --output=json`
    (helpers.assert_map_agrees: holes where map says hole, data where data);
  * `qcowfs info --json` equals `qemu-img info --output=json` on the fields
    qemu-img prints (actual-size aside, which depends on the host);
  * `qcowfs map --json` equals `qemu-img map --output=json`.

`check_image_direct()` does the content check through a 4096-byte-sector host
file system with cache=none. Everything here fails with a message naming the
image and the first difference.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Sequence

from qcowfs_testlib import helpers

KiB, MiB = 1 << 10, 1 << 20


def scattered_writes(size: int, block: int, seed: int = 1) -> list[str]:
    """qemu-io commands that leave data, zeros and unallocated ranges across a
    disk of `size` bytes whose allocation unit is `block`: whole blocks, a
    write crossing a block boundary, unaligned sector-sized writes, zeroed
    ranges (write -z) over data and over holes, and the last sector."""
    rng = random.Random(seed)
    blocks = max(1, size // block)
    cmds = [f"write -P 0x11 0 {min(block, size)}"]
    for i in range(6):
        b = rng.randrange(blocks)
        off = b * block + rng.randrange(0, max(1, block // 512)) * 512
        length = min(rng.choice([512, 4 * KiB, 64 * KiB, block]), size - off)
        if length > 0:
            cmds.append(f"write -P {0x20 + i} {off} {length}")
    if blocks > 2:
        edge = (blocks // 2) * block - 4 * KiB
        cmds.append(f"write -P 0x40 {edge} {8 * KiB}")  # crosses a block boundary
    cmds.append(f"write -P 0x41 {min(size - 512, 3 * block + 1536) // 512 * 512} 512")
    cmds.append(f"write -z {min(block, size) // 2 // 512 * 512} 4096")  # zeros over data
    if blocks > 4:
        cmds.append(f"write -z {(blocks - 3) * block} {min(block, 64 * KiB)}")  # zeros over a hole
    cmds.append(f"write -P 0x42 {size - 512} 512")  # the last sector
    return cmds


def make_image(workdir: Path, fmt: str, name: str, size: int, create_opts: str = "",
               cmds: Sequence[str] = (), *, stream: bool = False) -> Path:
    """qemu-img create -f fmt [-o create_opts] then qemu-io cmds on it. With
    stream=True the commands go to a raw image first, which qemu-img convert
    then turns into the format (streamOptimized VMDKs are written that way)."""
    image = workdir / name
    if stream:
        raw = workdir / f"{name}.src.raw"
        helpers.run(["qemu-img", "create", "-q", "-f", "raw", raw, str(size)])
        if cmds:
            helpers.qemu_io(raw, *cmds, fmt="raw")
        opts = ["-o", create_opts] if create_opts else []
        helpers.run(["qemu-img", "convert", "-f", "raw", "-O", fmt, *opts, raw, image])
        raw.unlink()
        return image
    opts = ["-o", create_opts] if create_opts else []
    helpers.run(["qemu-img", "create", "-q", "-f", fmt, *opts, image, str(size)])
    if cmds:
        helpers.qemu_io(image, *cmds, fmt=fmt)
    return image


def qcowfs_json(*args: str | os.PathLike) -> object:
    proc = helpers.run([helpers.qcowfs_bin(), *map(str, args)], check=False)
    assert proc.returncode == 0, (
        f"qcowfs {' '.join(map(str, args))} failed: {proc.stderr.decode(errors='replace')}")
    return json.loads(proc.stdout)


def strip_actual_size(info: object) -> object:
    """qemu-img info without the fields that depend on the host (actual-size),
    recursively through backing-image."""
    if isinstance(info, dict):
        return {k: strip_actual_size(v) for k, v in info.items() if k != "actual-size"}
    if isinstance(info, list):
        return [strip_actual_size(v) for v in info]
    return info


def assert_info_matches(image: Path, fmt: str | None = None) -> None:
    f = ["-f", fmt] if fmt else []
    ours = qcowfs_json("info", "--json", *f, image)
    theirs = json.loads(helpers.qemu_img("info", "--output=json", *f, str(image)))
    assert strip_actual_size(ours) == strip_actual_size(theirs), (
        f"info of {image} differs from qemu-img's:\nours:   {json.dumps(ours, sort_keys=True)}\n"
        f"qemu's: {json.dumps(theirs, sort_keys=True)}")


def assert_map_matches(image: Path, fmt: str | None = None) -> None:
    f = ["-f", fmt] if fmt else []
    ours = qcowfs_json("map", "--json", *f, image)
    theirs = json.loads(helpers.qemu_img("map", "--output=json", *f, str(image)))
    assert ours == theirs, (
        f"map of {image} differs from qemu-img's:\nours:   {json.dumps(ours)}\nqemu's: {json.dumps(theirs)}")


def assert_view_equals(view: Path, reference: Path, image: Path) -> None:
    size = reference.stat().st_size
    assert view.stat().st_size == size, f"{image}: view is {view.stat().st_size} bytes, qemu-img says {size}"
    assert helpers.files_equal(view, reference), f"{image}: the view differs from qemu-img convert -O raw"
    # Unaligned and odd-sized reads at a few points (the whole-file compare reads in big chunks).
    rng = random.Random(size)
    with open(view, "rb") as v, open(reference, "rb") as r:
        for _ in range(24):
            off = rng.randrange(size)
            n = min(size - off, rng.choice([1, 511, 4097, 70000, 1 << 20]))
            assert helpers.read_exact(v, off, n) == helpers.read_exact(r, off, n), (
                f"{image}: {n} bytes at {off} differ from qemu-img convert")


def check_image(image: Path, workdir: Path, *, fmt: str | None = None, mount_opts: Sequence[str] = (),
                info: bool = True, map_json: bool = True) -> None:
    """The whole read-only check of one image (see the module docstring)."""
    reference = helpers.convert_to_raw(image, workdir / f"{image.name}.qemu.raw", fmt=fmt)
    opts = list(mount_opts) + ([f"format={fmt}"] if fmt else [])
    view_dir = workdir / f"{image.name}.view"
    view_dir.mkdir(exist_ok=True)
    with helpers.mounted(image, view_dir / "disk.raw", opts) as m:
        assert_view_equals(m.path, reference, image)
        entries = helpers.qemu_img_map(image, fmt=fmt)
        helpers.assert_map_agrees(entries, helpers.data_extents(m.path))
    if info:
        assert_info_matches(image, fmt)
    if map_json:
        assert_map_matches(image, fmt)
    reference.unlink()


def check_image_direct(image: Path, workdir: Path, *, fmt: str | None = None) -> None:
    """The content check with cache=none through a 4096-byte-sector host file
    system (O_DIRECT reads at the host's alignment)."""
    reference = helpers.convert_to_raw(image, workdir / f"{image.name}.qemu.raw", fmt=fmt)
    with helpers.host_fs_on_4k_device(workdir) as host:
        moved = host / image.name
        shutil.copy(image, moved)
        opts = ["cache=none"] + ([f"format={fmt}"] if fmt else [])
        with helpers.mounted(moved, host / "disk.raw", opts) as m:
            assert_view_equals(m.path, reference, image)
    reference.unlink()


def secret_image_opts(image: Path, fmt: str) -> str:
    """qemu-img/qemu-io --image-opts for an encrypted image whose passphrase is
    the secret object s0 (raw LUKS, or qcow2 with LUKS or legacy AES)."""
    if fmt == "luks":
        return f"driver=luks,key-secret=s0,file.filename={image}"
    return f"driver=qcow2,encrypt.key-secret=s0,file.filename={image}"


# A writer that stamps 64 KiB slots (8-byte counters) from `base` on, 256 slots
# round robin, with an fsync after every 8 writes; it prints the number of
# writes done at each completed fsync.
KILL9_WRITER = r"""
import os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
base = int(sys.argv[2])
i = 0
while True:
    os.pwrite(fd, (b"%08d" % i) * 8192, base + (i % 256) * 65536)
    i += 1
    if i % 8 == 0:
        os.fsync(fd)
        print(i, flush=True)
"""
KILL9_SLOTS_AT = 40 * MiB  # the stamped slots: [40 MiB, 56 MiB); fio writes [0, 32 MiB)


def kill9_under_write_load(img: Path, fmt: str, workdir: Path, unclean: str | None = None) -> None:
    """kill -9 of a read-write mount of img (at least 56 MiB) under fio random
    writes with fsync and the stamping writer; then qemu-img check finds no
    corruption (leaks allowed) and every slot holds its last write
    acknowledged before the last completed fsync, or a newer one. `unclean`:
    the one error QEMU's check reports for a format whose in-use flag an
    unclosed image keeps (Parallels); `qemu-img check -r all` must then find
    that alone and clear it before the checks. A VHDX log entry left pending
    is replayed by QEMU first (as a read-write open does)."""
    if shutil.which("fio") is None:
        raise AssertionError("fio is not installed (tests/setup-deps.sh)")
    view = workdir / "view.raw"
    view.touch()
    proc = subprocess.Popen([helpers.qcowfs_bin(), "-f", "-o", f"rw,format={fmt}", img, view],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    fio = writer = None
    synced = 0
    try:
        deadline = time.monotonic() + 10
        while not helpers.is_fuse_mounted(view):
            assert time.monotonic() < deadline and proc.poll() is None, "mount failed"
            time.sleep(0.05)
        fio = subprocess.Popen(["fio", "--name=k", f"--filename={view}", "--rw=randwrite", "--bs=4k",
                                "--size=32M", "--offset=0", "--time_based", "--runtime=30",
                                "--fsync=16", "--ioengine=psync"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        writer = subprocess.Popen(["python3", "-c", KILL9_WRITER, str(view), str(KILL9_SLOTS_AT)],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        start = time.monotonic()
        while time.monotonic() - start < 3:
            line = writer.stdout.readline()
            if not line:
                break
            synced = int(line)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        for p in (fio, writer):
            if p and p.poll() is None:
                p.kill()
                with contextlib.suppress(Exception):
                    p.wait(timeout=10)
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        helpers.run(["fusermount3", "-u", "-z", view], check=False)
    assert synced >= 8, "the writer never completed an fsync before the kill"
    if unclean:
        repair = helpers.run(["qemu-img", "check", "-r", "all", "-f", fmt, img], check=False)
        text = repair.stdout.decode() + repair.stderr.decode()
        found = [line for line in text.splitlines()
                 if line.startswith(("ERROR", "Repairing")) and "leaked" not in line]
        assert found == [f"Repairing {unclean}"], f"qemu-img check -r all after kill -9: {text}"
    if fmt == "vhdx":
        # A log entry the kill left pending: QEMU replays it on a read-write open
        # (and refuses a read-only one until then), as qcowfs does.
        replay = helpers.run(["qemu-img", "check", "-r", "leaks", "-f", fmt, img], check=False)
        assert replay.returncode in (0, 3), (
            f"qemu-img check -r leaks (log replay) after kill -9: exit {replay.returncode}\n"
            f"{replay.stdout.decode()}{replay.stderr.decode()}")
    if fmt != "vpc":  # vpc: "This image format does not support checks" (the bytes are compared below)
        report = helpers.run(["qemu-img", "check", "--output=json", "-f", fmt, img], check=False)
        assert report.returncode in (0, 3), (  # 3: leaks only, allowed after a crash
            f"qemu-img check after kill -9: exit {report.returncode}\n{report.stdout.decode()}"
            f"{report.stderr.decode()}")
    out = workdir / "out.raw"
    helpers.run(["qemu-img", "convert", "-f", fmt, "-O", "raw", img, out])
    with open(out, "rb") as f:
        # Every slot's last write acknowledged before the last completed fsync.
        for slot in range(min(synced, 256)):
            last = max(i for i in range(synced) if i % 256 == slot)
            f.seek(KILL9_SLOTS_AT + slot * 65536)
            got = f.read(65536)
            # A later (unsynced) write may also have landed, even partly: every
            # 8-byte stamp must be that write or a newer one, never older or garbage.
            for k in range(0, 65536, 8):
                stamp = got[k:k + 8]
                assert stamp.isdigit(), f"slot {slot} holds garbage at +{k}: {stamp!r}"
                assert int(stamp) >= last and int(stamp) % 256 == slot, (
                    f"slot {slot} lost fsynced write {last} (has {int(stamp)} at +{k})")
