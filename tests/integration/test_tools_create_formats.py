"""`qcowfs create -f FMT` for the formats created through the registry (QED,
VDI, Parallels, VHDX), with qemu-img 7.2 as the referee.

For each option set: qcowfs's image and qemu-img's (same options) are
byte-identical except for the fields QEMU fills at random (UUIDs/GUIDs, named
per format in RANDOM_FIELDS); both pass `qemu-img check`; `qemu-img info
--output=json` says the same of both; the "Formatting" lines are equal. Per
format, an image qcowfs made is mounted read-write, written, and compared with
`qemu-img compare` against the expected raw; bad options are refused with exit
1 and leave no file behind.
"""

from __future__ import annotations

import json
import struct
import subprocess
from pathlib import Path
from typing import Callable

import pytest

from qcowfs_testlib import helpers

KiB, MiB = 1 << 10, 1 << 20

# (format, -o options, size or None for the backing file's)
CREATE_CASES = [
    ("qed", "", "5M"),
    ("qed", "cluster_size=4K,table_size=2", "5M"),
    ("qed", "cluster_size=256K,table_size=8", "3M"),
    ("qed", "table_size=1,cluster_size=4K", "1000"),
    ("vdi", "", "1500K"),
    ("vdi", "static=on", "1500K"),
    ("parallels", "", "3000K"),
    ("parallels", "cluster_size=64K", "3000K"),
    ("parallels", "cluster_size=1000", "1000"),  # both rounded up to whole sectors
    ("vhdx", "", "10M"),
    ("vhdx", "subformat=fixed", "3M"),
    ("vhdx", "subformat=fixed,block_state_zero=off", "3M"),
    ("vhdx", "block_state_zero=off,subformat=dynamic,block_size=1M,log_size=2M", "3M"),
    ("vhdx", "block_size=1,log_size=1500K", "1000"),  # rounded up: 1 MiB blocks, 2 MiB log, 1024 bytes
    ("vhdx", "", "2G"),  # the block size chosen from the size: 16 MiB
]



def vhdx_random_fields(image: bytes) -> list[tuple[int, int]]:
    """The file identifier's creator (QEMU writes "QEMU v7.2.x", qcowfs
    "qcowfs"); in both headers the checksum, the sequence number (random) and
    the file and data write GUIDs; the page 83 GUID among the metadata items
    (at 64 KiB into the metadata region, whose offset the region table gives)."""
    metadata = struct.unpack_from("<Q", image, 192 * KiB + 16 + 32 + 16)[0]
    return [(8, 512), (64 * KiB + 4, 44), (128 * KiB + 4, 44), (metadata + 64 * KiB + 16, 16)]


# Ranges of bytes filled at random (or naming the creator) at create:
# (offset, length), found in qemu-img's image.
RANDOM_FIELDS: dict[str, Callable[[bytes], list[tuple[int, int]]]] = {
    "qed": lambda _: [],
    "vdi": lambda _: [(392, 16), (408, 16)],  # uuid_image, uuid_last_snap
    "parallels": lambda _: [],
    "vhdx": vhdx_random_fields,
}

# (format, -o options, size, the message qcowfs must print)
BAD_CASES = [
    ("qed", "cluster_size=3K", "1M", "QED cluster size must be within range [4096, 67108864] and power of 2"),
    ("qed", "table_size=32", "1M", "QED table size must be within range [1, 16] and power of 2"),
    ("qed", "cluster_size=4K,table_size=1", "2G", "QED image size must be a non-zero multiple of cluster size "
     "and less than 1073741824 bytes"),
    ("qed", "static=on", "1M", "Invalid parameter 'static'"),
    ("vdi", "static=maybe", "1M", "Parameter 'static' expects 'on' or 'off'"),
    ("vdi", "", "1P", "Unsupported VDI image size (size is 0x4000000000000, max supported is 0x1fffff8000000)"),
    ("vdi", "cluster_size=1M", "1M", "Invalid parameter 'cluster_size'"),
    ("parallels", "cluster_size=2G", "1M", "Cluster size is too large"),
    ("parallels", "cluster_size=4K", "16T", "Image size is too large for this cluster size"),
    ("parallels", "cluster_size=0", "1M", "Image size is too large for this cluster size"),
    ("parallels", "static=on", "1M", "Invalid parameter 'static'"),
    ("vhdx", "block_size=3M", "10M", "Block size must be a power of two"),
    ("vhdx", "log_size=5G", "10M", "Log size must be smaller than 4 GB"),
    ("vhdx", "log_size=0", "10M", "Log size must be a multiple of 1 MB"),
    ("vhdx", "subformat=foo", "10M", "Parameter 'subformat' does not accept value 'foo'"),
    ("vhdx", "block_state_zero=maybe", "10M", "Parameter 'block_state_zero' expects 'on' or 'off'"),
    ("vhdx", "", "65T", "Image size too large; max of 64TB"),
    ("vhdx", "cluster_size=64K", "10M", "Invalid parameter 'cluster_size'"),
]


def run_create(tool: list[str], fmt: str, opts: str, image: Path, size: str | None,
               extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    args = [*tool, "create", "-f", fmt, *extra, *(["-o", opts] if opts else []), str(image)]
    return helpers.run(args + ([size] if size else []), check=False)


def formatting_line(proc: subprocess.CompletedProcess, image: Path) -> str:
    out = proc.stdout.decode()
    assert proc.returncode == 0, f"create {image} failed: {out}{proc.stderr.decode(errors='replace')}"
    line = out.strip()
    prefix = f"Formatting '{image}', "
    assert line.startswith(prefix), f"unexpected output: {line!r}"
    return line[len(prefix):]


def create_both(workdir: Path, fmt: str, opts: str, size: str | None, extra: tuple[str, ...] = ()):
    ours, theirs = workdir / f"ours.{fmt}", workdir / f"qemu.{fmt}"
    for f in (ours, theirs):
        f.unlink(missing_ok=True)
    line_ours = formatting_line(run_create([helpers.qcowfs_bin()], fmt, opts, ours, size, extra), ours)
    line_qemu = formatting_line(run_create(["qemu-img"], fmt, opts, theirs, size, extra), theirs)
    assert line_ours == line_qemu, f"Formatting line: ours {line_ours!r}, qemu-img {line_qemu!r}"
    return ours, theirs


def assert_same_image(fmt: str, ours: Path, theirs: Path) -> None:
    a, b = ours.read_bytes(), theirs.read_bytes()
    assert len(a) == len(b), f"{fmt}: file size {len(a)}, qemu-img's {len(b)}"
    fields = sorted(RANDOM_FIELDS[fmt](b))
    va, vb = memoryview(a), memoryview(b)
    at = 0
    for off, n in [*fields, (len(a), 0)]:  # compare the bytes between the random fields
        if va[at:off] != vb[at:off]:
            first = at + helpers.first_difference(bytes(va[at:off]), bytes(vb[at:off]))
            raise AssertionError(f"{fmt}: first difference from qemu-img's image at byte {first}")
        assert n == 0 or a[off:off + n] != bytes(n), f"{fmt}: random field at {off} is left zero"
        at = off + n


def info(image: Path, fmt: str) -> dict:
    d = json.loads(helpers.qemu_img("info", "--output=json", "-f", fmt, str(image)))
    for k in ("actual-size", "filename", "full-backing-filename"):
        d.pop(k, None)
    return d


def check_clean(image: Path, fmt: str) -> None:
    helpers.qemu_img_check(image, fmt)


@pytest.mark.parametrize("fmt,opts,size", CREATE_CASES, ids=[f"{c[0]}-{c[1] or 'default'}" for c in CREATE_CASES])
def test_create_matches_qemu_img(workdir: Path, fmt: str, opts: str, size: str) -> None:
    ours, theirs = create_both(workdir, fmt, opts, size)
    assert_same_image(fmt, ours, theirs)
    if not (fmt == "qed" and "table_size=1" in opts):  # QEMU cannot open one-cluster QED tables
        check_clean(ours, fmt)
        assert info(ours, fmt) == info(theirs, fmt)


@pytest.mark.parametrize("fmt,opts,size,message", BAD_CASES, ids=[f"{c[0]}-{c[1]}" for c in BAD_CASES])
def test_create_refuses(workdir: Path, fmt: str, opts: str, size: str, message: str) -> None:
    image = workdir / f"bad.{fmt}"
    proc = run_create([helpers.qcowfs_bin()], fmt, opts, image, size)
    err = proc.stderr.decode(errors="replace")
    assert proc.returncode == 1, f"exit {proc.returncode}: {err}"
    assert message in err, err
    assert not image.exists(), "a refused create left its file behind"
    assert proc.stdout == b"", "a refused create printed its Formatting line"


def test_create_missing_size(workdir: Path) -> None:
    for fmt in sorted({c[0] for c in CREATE_CASES}):
        proc = run_create([helpers.qcowfs_bin()], fmt, "", workdir / f"nosize.{fmt}", None)
        assert proc.returncode == 1 and b"Image creation needs a size parameter" in proc.stderr, proc.stderr


@pytest.mark.parametrize("fmt,opts", [("qed", "cluster_size=4K"), ("vdi", ""), ("vdi", "static=on"), ("parallels", "cluster_size=64K"),
                                      ("vhdx", ""),
                                      ("vhdx", "subformat=fixed,block_state_zero=off")])
def test_created_image_mounts_rw(workdir: Path, fmt: str, opts: str) -> None:
    """A small write through a read-write mount of a fresh image, then qemu-img
    compare against the expected raw and a clean check."""
    image = workdir / f"rw.{fmt}"
    formatting_line(run_create([helpers.qcowfs_bin()], fmt, opts, image, "4M"), image)
    expected = bytearray(4 * MiB)
    with helpers.mounted(image, workdir / "view.raw", ["rw"]) as m:
        with open(m.path, "r+b") as v:
            for off, data in ((0, b"\x11" * 4096), (3 * MiB - 100, b"\x22" * 5000), (4 * MiB - 512, b"\x33" * 512)):
                v.seek(off)
                v.write(data)
                expected[off:off + len(data)] = data
    raw = workdir / "expected.raw"
    raw.write_bytes(expected)
    helpers.qemu_img("compare", "-f", fmt, "-F", "raw", str(image), str(raw))
    check_clean(image, fmt)


def test_qed_backing_file(workdir: Path) -> None:
    """-b/-F: the size defaults to the backing file's, the header names it (a
    raw one marked not to be probed), and the overlay reads through to it."""
    base = workdir / "base.raw"
    base.write_bytes(b"\x5a" * (3 * MiB))
    for opts, extra in (("", ("-b", "base.raw", "-F", "raw")), ("backing_file=base.raw,backing_fmt=raw", ())):
        ours, theirs = create_both(workdir, "qed", opts, None, extra)
        assert_same_image("qed", ours, theirs)
        check_clean(ours, "qed")
        got = info(ours, "qed")
        assert got == info(theirs, "qed")
        assert got["virtual-size"] == 3 * MiB and got["backing-filename"] == "base.raw"
        assert got["backing-filename-format"] == "raw"
        helpers.qemu_img("compare", "-f", "qed", "-F", "raw", str(ours), str(base))
    # A backing file of another format is left to QEMU's probe (no NO_PROBE bit).
    helpers.run(["qemu-img", "create", "-q", "-f", "qcow2", workdir / "base.qcow2", "2M"])
    ours, theirs = create_both(workdir, "qed", "", None, ("-b", "base.qcow2", "-F", "qcow2"))
    assert_same_image("qed", ours, theirs)
    got = info(ours, "qed")
    assert got == info(theirs, "qed") and got["virtual-size"] == 2 * MiB
    assert "backing-filename-format" not in got  # QED records no format but raw's bit


@pytest.mark.parametrize("fmt", ["vdi", "parallels", "vhdx"])
def test_backing_file_refused(workdir: Path, fmt: str) -> None:
    """Formats without backing files refuse -b (and a lone backing_fmt) as qemu-img does."""
    base = workdir / "base.raw"
    base.write_bytes(bytes(MiB))
    image = workdir / f"overlay.{fmt}"
    for extra, opts, message in (
            (("-b", "base.raw", "-F", "raw"), "", f"Backing file not supported for file format '{fmt}'"),
            ((), "backing_fmt=raw", "Invalid parameter 'backing_fmt'")):
        proc = run_create([helpers.qcowfs_bin()], fmt, opts, image, "1M", extra)
        err = proc.stderr.decode(errors="replace")
        assert proc.returncode == 1 and message in err, f"exit {proc.returncode}: {err}"
        assert not image.exists(), "a refused create left its file behind"


def test_create_help_lists_the_formats() -> None:
    out = helpers.run([helpers.qcowfs_bin(), "create", "--help"]).stdout.decode()
    for word in ("qed", "vdi", "parallels", "vhdx", "table_size=", "static=", "subformat=", "block_size=",
                 "log_size=", "block_state_zero="):
        assert word in out, word


def test_qed_backing_name_must_fit_the_header_cluster(workdir: Path) -> None:
    """QEMU would write a name longer than its header cluster over the L1
    table and make an image it cannot open; qcowfs refuses it."""
    image = workdir / "long.qed"
    proc = run_create([helpers.qcowfs_bin()], "qed", "cluster_size=4K", image, "1M",
                      ("-u", "-b", "b" * 4040, "-F", "raw"))
    err = proc.stderr.decode(errors="replace")
    assert proc.returncode == 1 and "backing file name (4040 bytes) does not fit" in err, err
    assert not image.exists()


@pytest.mark.parametrize("held", ["image", "extent"])
def test_a_file_in_use_fails_the_create_and_nothing_is_emptied(workdir, held):
    """Every file a create writes (the image and, for a flat VMDK, its extent) is
    locked before any is emptied: with one of them in use, both stay as they were."""
    image, extent = workdir / "x.vmdk", workdir / "x-flat.vmdk"
    helpers.run(["qemu-img", "create", "-q", "-f", "vmdk", "-o", "subformat=monolithicFlat", image, "1M"])
    helpers.qemu_io(extent, "write -P 0x5a 0 64k", fmt="raw")
    before = {p: helpers.sha256_file(p) for p in (image, extent)}
    target = image if held == "image" else extent
    with helpers.qemu_io_holding(target, "vmdk" if held == "image" else "raw"):
        r = helpers.run([helpers.qcowfs_bin(), "create", "-q", "-f", "vmdk", "-o", "subformat=monolithicFlat",
                         image, "2M"], check=False)
        assert r.returncode == 1
        assert '"write" lock' in r.stderr.decode(), r.stderr.decode()
    assert {p: helpers.sha256_file(p) for p in (image, extent)} == before
