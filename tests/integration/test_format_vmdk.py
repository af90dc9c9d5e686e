"""VMDK images read through qcowfs, with QEMU as the referee (format_helpers):
monolithicSparse (also with zeroed grains), monolithicFlat, the split
twoGbMaxExtent* kinds over a disk a little over 2 GiB (compared around the
extent boundary and at both ends, to stay cheap), streamOptimized (also
out of an OVA tar), a delta disk over its parent (refused once the parent was
written since), a qcow2 overlay over a VMDK, and a hand-written descriptor
with a ZERO extent and FLAT extents in another order than their files. A
read-write mount of a streamOptimized image is refused and changes nothing."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from qcowfs_testlib import create_helpers as ch
from qcowfs_testlib import format_helpers as fh
from qcowfs_testlib import helpers

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SIZE = 32 * MiB
GRAIN = 64 * KiB


def writes(size: int = SIZE) -> list[str]:
    return fh.scattered_writes(size, GRAIN, seed=7)


@pytest.mark.parametrize("opts", ["", "zeroed_grain=on", "subformat=monolithicFlat"],
                         ids=["monolithicSparse", "zeroed_grain", "monolithicFlat"])
def test_monolithic(workdir: Path, opts: str) -> None:
    image = fh.make_image(workdir, "vmdk", "disk.vmdk", SIZE, opts, writes())
    fh.check_image(image, workdir, fmt="vmdk")
    if "subformat" not in opts:  # one file: check_image_direct copies only the image
        fh.check_image_direct(image, workdir, fmt="vmdk")


def test_zeroed_grains_are_present_zeros(workdir: Path) -> None:
    """With zeroed_grain=on, write -z over whole grains leaves zeroed-grain entries (1)."""
    image = fh.make_image(workdir, "vmdk", "disk.vmdk", SIZE, "zeroed_grain=on",
                          ["write -P 0x33 0 1M", "write -z 256k 256k", "write -z 4M 128k"])
    entries = helpers.qemu_img_map(image, fmt="vmdk")
    assert any(e["present"] and e["zero"] and not e["data"] for e in entries), entries
    fh.check_image(image, workdir, fmt="vmdk")


@pytest.mark.parametrize("sub", ["twoGbMaxExtentSparse", "twoGbMaxExtentFlat"])
def test_split_extents(workdir: Path, sub: str) -> None:
    size = 2 * GiB + 8 * MiB
    edge = 2 * GiB
    image = fh.make_image(workdir, "vmdk", "disk.vmdk", size, f"subformat={sub}",
                          ["write -P 0x11 0 64k", f"write -P 0x22 {edge - 8 * KiB} 16k",
                           f"write -P 0x33 {edge + 1 * MiB} 4k", f"write -P 0x44 {size - 512} 512"])
    assert len(list(workdir.glob("disk-*.vmdk"))) == 2
    check_large(image, workdir, [(0, 1 * MiB), (edge - 4 * MiB, 8 * MiB), (size - 1 * MiB, 1 * MiB)])


def check_large(image: Path, workdir: Path, ranges: list[tuple[int, int]]) -> None:
    """check_image for a disk too large to compare whole in a cheap test: the given
    ranges byte for byte (and odd-sized reads across them), SEEK_DATA/HOLE, info, map."""
    ref = helpers.convert_to_raw(image, workdir / "ref.raw", fmt="vmdk")
    view_dir = workdir / "view"
    view_dir.mkdir()
    with helpers.mounted(image, view_dir / "disk.raw", ["format=vmdk"]) as m:
        assert m.path.stat().st_size == ref.stat().st_size
        with open(m.path, "rb") as v, open(ref, "rb") as r:
            for off, n in ranges:
                for step in (n, 70000, 4097):
                    for o in range(off, off + n, step):
                        k = min(step, off + n - o)
                        assert helpers.read_exact(v, o, k) == helpers.read_exact(r, o, k), f"{image}: {k} at {o}"
        helpers.assert_map_agrees(helpers.qemu_img_map(image, fmt="vmdk"), helpers.data_extents(m.path))
    fh.assert_info_matches(image, "vmdk")
    fh.assert_map_matches(image, "vmdk")


def test_stream_optimized(workdir: Path) -> None:
    image = fh.make_image(workdir, "vmdk", "disk.vmdk", SIZE, "subformat=streamOptimized", writes(), stream=True)
    assert helpers.qemu_img_info(image, fmt="vmdk")["format-specific"]["data"]["create-type"] == "streamOptimized"
    fh.check_image(image, workdir, fmt="vmdk")
    fh.check_image_direct(image, workdir, fmt="vmdk")


def test_ova_appliance(workdir: Path) -> None:
    """An OVA is a tar of an OVF descriptor and streamOptimized disks: extracted, the disk mounts."""
    disk = fh.make_image(workdir, "vmdk", "disk.vmdk", SIZE, "subformat=streamOptimized", writes(), stream=True)
    (workdir / "desc.ovf").write_text("<?xml version='1.0'?><Envelope><References>"
                                      "<File ovf:href='disk.vmdk'/></References></Envelope>\n")
    helpers.run(["tar", "cf", workdir / "appliance.ova", "-C", workdir, "desc.ovf", "disk.vmdk"])
    out = workdir / "extracted"
    out.mkdir()
    helpers.run(["tar", "xf", workdir / "appliance.ova", "-C", out])
    extracted = out / "disk.vmdk"
    assert helpers.sha256_file(extracted) == helpers.sha256_file(disk)
    fh.check_image(extracted, out, fmt="vmdk")


def base_and_delta(workdir: Path) -> tuple[Path, Path]:
    base = fh.make_image(workdir, "vmdk", "base.vmdk", SIZE, "", ["write -P 0x5a 0 8M", "write -P 0x5b 20M 1M"])
    delta = workdir / "delta.vmdk"
    helpers.run(["qemu-img", "create", "-q", "-f", "vmdk", "-b", "base.vmdk", "-F", "vmdk", delta])
    helpers.qemu_io(delta, "write -P 0x61 64k 64k", "write -P 0x62 1M 4k", "write -P 0x63 21M 64k", fmt="vmdk")
    return base, delta


def test_delta_over_base(workdir: Path) -> None:
    _, delta = base_and_delta(workdir)
    info = helpers.qemu_img_info(delta, fmt="vmdk")
    assert info["backing-filename"] == "base.vmdk", info
    fh.check_image(delta, workdir, fmt="vmdk")


def descriptor_cids(image: Path) -> tuple[int, int]:
    """(CID, parentCID) as qemu-img info shows them."""
    data = helpers.qemu_img_info(image, fmt="vmdk")["format-specific"]["data"]
    return data["cid"], data["parent-cid"]


def test_delta_whose_parent_changed_is_refused_and_a_fresh_one_mounts_rw(workdir: Path) -> None:
    """A write through a read-write mount gives the parent a new CID; the delta made
    before it (parentCID the old CID) is refused by the mount, info and map with both
    files and both CIDs named, and so is a delta of that delta (the chain is checked
    level by level). QEMU agrees: reads of the stale delta that reach the parent fail,
    though qemu-img info still describes it. A delta made after the write mounts
    read-write, and qemu-img check and convert agree with what was written."""
    parent = fh.make_image(workdir, "vmdk", "parent.vmdk", 4 * MiB, "", ["write -P 0x5a 0 2M"])
    delta, top = workdir / "delta.vmdk", workdir / "top.vmdk"
    helpers.run(["qemu-img", "create", "-q", "-f", "vmdk", "-b", "parent.vmdk", "-F", "vmdk", delta])
    helpers.run(["qemu-img", "create", "-q", "-f", "vmdk", "-b", "delta.vmdk", "-F", "vmdk", top])
    with helpers.mounted(parent, workdir / "parent.raw", ["rw"]) as m:
        with open(m.path, "r+b") as f:
            f.seek(1 * MiB)
            f.write(b"\x7e" * 4096)
    parent_cid, _ = descriptor_cids(parent)
    _, recorded = descriptor_cids(delta)
    assert parent_cid != recorded, "the write through the mount did not change the parent's CID"
    cids = (f"parentCID {recorded:08x}", f"parent's CID {parent_cid:08x}")

    def refused(text: str, what: str) -> None:
        for word in ("delta.vmdk", "parent.vmdk", "modified since", *cids):
            assert word in text, f"{what}: {word!r} missing from: {text}"

    for image in (delta, top):
        _, text = helpers.mount_fails(image, workdir / "view.raw")
        refused(text, f"mount of {image.name}")
    _, text = helpers.mount_fails(delta, workdir / "view.raw", ["rw"])
    refused(text, "rw mount of delta.vmdk")
    for args in (["info", delta], ["info", "--json", "--backing-chain", top], ["map", delta], ["map", top]):
        proc = helpers.run([helpers.qcowfs_bin(), *map(str, args)], check=False)
        assert proc.returncode != 0, f"qcowfs {args} accepted the stale delta"
        refused(proc.stderr.decode(errors="replace"), f"qcowfs {args}")
    # QEMU: the open succeeds (info describes the delta), every read that reaches
    # the parent fails with EINVAL (vmdk_is_cid_valid).
    assert helpers.qemu_img_info(delta, fmt="vmdk")["backing-filename"] == "parent.vmdk"
    proc = helpers.run(["qemu-io", "-f", "vmdk", "-r", "-c", "read 0 512", delta], check=False)
    out = (proc.stdout + proc.stderr).decode(errors="replace")
    assert "Invalid argument" in out, f"QEMU read the stale delta: {out}"

    fresh = workdir / "fresh.vmdk"
    helpers.run(["qemu-img", "create", "-q", "-f", "vmdk", "-b", "parent.vmdk", "-F", "vmdk", fresh])
    copy = workdir / "copy.raw"
    with helpers.mounted(fresh, workdir / "fresh.raw", ["rw"]) as m:
        with open(m.path, "r+b") as f:
            f.seek(1 * MiB + 2048)
            f.write(b"\x61" * 70000)
            f.flush()
            os.fsync(f.fileno())
        shutil.copyfile(m.path, copy)
    helpers.qemu_img_check(fresh, "vmdk")
    assert helpers.files_equal(helpers.convert_to_raw(fresh, workdir / "fresh.ref", fmt="vmdk"), copy)
    # qemu_io raises on a pattern mismatch.
    helpers.qemu_io(fresh, "read -P 0x7e 1M 2k", "read -P 0x61 1050624 70000", "read -P 0x5a 1200k 64k",
                    fmt="vmdk", extra=["-r"])


def test_qcow2_over_vmdk(workdir: Path) -> None:
    base = fh.make_image(workdir, "vmdk", "base.vmdk", SIZE, "", ["write -P 0x5a 0 2M", "write -P 0x5c 9M 64k"])
    top = workdir / "top.qcow2"
    helpers.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", base.name, "-F", "vmdk", top])
    helpers.qemu_io(top, "write -P 0x71 1M 64k", "write -P 0x72 9M 4k", fmt="qcow2")
    fh.check_image(top, workdir, fmt="qcow2")


def test_descriptor_with_zero_extent_and_flat_extents_out_of_order(workdir: Path) -> None:
    """QEMU skips ZERO (and non-RW) extent lines; FLAT extents map consecutive guest
    ranges onto whatever files and offsets the lines name."""
    a, b = workdir / "a.bin", workdir / "b.bin"
    a.write_bytes(bytes([0xaa]) * (1 * MiB) + bytes(1 * MiB) + bytes([0xab]) * (2 * MiB))
    b.write_bytes(bytes([0xbb]) * (3 * MiB))
    desc = workdir / "hand.vmdk"
    desc.write_text(
        "# Disk DescriptorFile\nversion=1\nCID=12345678\nparentCID=ffffffff\n"
        'createType="monolithicFlat"\n\n# Extent description\n'
        'RW 4096 FLAT "b.bin" 1024\n'
        'RW 2048 ZERO\n'
        'RW 8192 FLAT "a.bin" 0\n'
        'RDONLY 2048 FLAT "b.bin" 0\n'
        'RW 1024 FLAT "b.bin" 0\n'
        '\n# The Disk Data Base\n#DDB\nddb.virtualHWVersion = "4"\n')
    info = helpers.qemu_img_info(desc, fmt="vmdk")
    assert info["virtual-size"] == (4096 + 8192 + 1024) * 512, info
    fh.check_image(desc, workdir, fmt="vmdk")
    # QEMU takes absolute extent names as they are.
    absolute = workdir / "absolute.vmdk"
    absolute.write_text(desc.read_text().replace('"b.bin"', f'"{b}"'))
    assert str(b) in json.dumps(helpers.qemu_img_info(absolute, fmt="vmdk"))
    fh.check_image(absolute, workdir, fmt="vmdk")


def test_info_of_a_split_sparse_image_names_every_extent(workdir: Path) -> None:
    image = fh.make_image(workdir, "vmdk", "disk.vmdk", 2 * GiB + MiB, "subformat=twoGbMaxExtentSparse")
    ours = fh.qcowfs_json("info", "--json", image)
    extents = ours["format-specific"]["data"]["extents"]
    assert [e["format"] for e in extents] == ["SPARSE", "SPARSE"], ours
    fh.assert_info_matches(image)  # probed, no -f
    fh.assert_info_matches(image, "vmdk")


def test_rw_mount_of_a_stream_optimized_image_is_refused(workdir: Path) -> None:
    image = fh.make_image(workdir, "vmdk", "disk.vmdk", SIZE, "subformat=streamOptimized", ["write -P 0x11 0 64k"])
    before = helpers.sha256_file(image)
    code, text = helpers.mount_fails(image, workdir / "view.raw", ["rw"])
    assert "streamOptimized" in text and "read-only" in text.lower(), text
    assert helpers.sha256_file(image) == before


def test_info_no_backing_opens_a_delta_without_its_parent(workdir: Path) -> None:
    base, delta = base_and_delta(workdir)
    base.unlink()
    theirs = json.loads(helpers.qemu_img("info", "--output=json", str(delta)))
    ours = fh.qcowfs_json("info", "--json", delta)
    assert fh.strip_actual_size(ours) == fh.strip_actual_size(theirs)
    (workdir / "v.raw").touch()
    proc = subprocess.run([helpers.qcowfs_bin(), "-f", "-o", "ro", str(delta), str(workdir / "v.raw")],
                          capture_output=True, timeout=30, check=False)
    assert proc.returncode != 0 and b"base.vmdk" in proc.stderr, proc.stderr


def test_stream_with_grain_directory_at_the_end(workdir: Path) -> None:
    """VMware's streamOptimized writers put the GD last: the header says "at end" and the
    footer (marker, header copy, end-of-stream marker) holds the real header. qemu-img
    writes the GD first, so the test moves it."""
    image = fh.make_image(workdir, "vmdk", "disk.vmdk", SIZE, "subformat=streamOptimized", writes(), stream=True)
    data = bytearray(image.read_bytes())
    head = bytes(data[:512])
    data += bytes(-len(data) % 512) + struct.pack("<QII", 1, 0, 3).ljust(512, b"\0") + head + bytes(512)
    data[56:64] = struct.pack("<Q", (1 << 64) - 1)  # gd_offset: at end
    image.write_bytes(bytes(data))
    fh.check_image(image, workdir, fmt="vmdk")


# ---- qcowfs create -f vmdk, refereed by qemu-img create 7.2 ----

# name: (options, size, writes through the rw mount, or None: streamOptimized is read-only)
CREATE_VARIANTS = {
    "monolithicSparse": ([], "5M", [(0, b"\x11" * 4096), (3 * MiB + 512, b"\x22" * 70000)]),
    "flat_lsilogic": (["-o", "subformat=monolithicFlat,adapter_type=lsilogic"], "3M",
                      [(MiB - 100, b"\x33" * 300)]),
    # Two extents each; the write crosses the 2 GiB boundary between them.
    "split_sparse": (["-o", "subformat=twoGbMaxExtentSparse,zeroed_grain=on,hwversion=7,preallocation=full"],
                     "2049M", [(2 * GiB - 4096, b"\x44" * 8192)]),
    "split_flat": (["-o", "subformat=twoGbMaxExtentFlat,adapter_type=legacyESX,toolsversion=10"], "2049M",
                   [(2 * GiB - 512, b"\x55" * 1024)]),
    "stream_compat6": (["-o", "subformat=streamOptimized,compat6=on,adapter_type=buslogic"], "1000", None),
}


def vmdk_parts(path: Path) -> tuple:
    """A file qemu-img created: (bytes before the descriptor, the descriptor with its
    random CID blanked, bytes after the descriptor's room); a flat extent: its size
    and whether its data ranges hold only zeros (qemu-img truncates it to size;
    QEMU's file driver allocates the first 4 KiB block of a new file, qcowfs not)."""
    with open(path, "rb") as f:
        if path.name != "d.vmdk" and f.read(4) != b"KDMV":
            zeros = all(not any(helpers.read_exact(f, lo, hi - lo)) for lo, hi in helpers.data_extents(path))
            return path.stat().st_size, zeros
    data = path.read_bytes()
    if data[:4] == b"KDMV":  # the descriptor in sectors 1-20
        head, text, tail = data[:512], data[512:512 + 20 * 512], data[512 + 20 * 512:]
    else:
        head, text, tail = b"", data, b""
    text, n = re.subn(rb"\nCID=[0-9a-f]{1,8}\n", b"\nCID=\n", text.rstrip(b"\0"))
    assert n == (1 if path.name == "d.vmdk" else 0), text
    return head, text, tail


@pytest.mark.parametrize("name", sorted(CREATE_VARIANTS))
def test_create_matches_qemu_img(workdir: Path, name: str) -> None:
    """The same files as qemu-img's, byte for byte but for the descriptor's random
    CID; the same qemu-img info; clean for qemu-img check; a write through a
    read-write mount lands where qemu-img compare expects it."""
    opts, size, rw_writes = CREATE_VARIANTS[name]
    theirs, ours = ch.create_side_by_side(workdir, "vmdk", opts, "d.vmdk", size)
    for f in sorted(theirs.parent.iterdir()):
        assert vmdk_parts(ours.parent / f.name) == vmdk_parts(f), f.name
    ch.assert_same_info(theirs, ours, "vmdk", ignore=["cid"])
    helpers.qemu_img_check(ours, fmt="vmdk")
    if rw_writes is None:
        assert helpers.files_equal(helpers.convert_to_raw(ours, fmt="vmdk"),
                                   helpers.convert_to_raw(theirs, fmt="vmdk"))
        return
    ch.write_through_rw_mount(ours, "vmdk", workdir, rw_writes)
    helpers.qemu_img_check(ours, fmt="vmdk")


def test_create_delta_over_a_vmdk_parent(workdir: Path) -> None:
    """-b/-F: the size defaults to the parent's, parentCID is the parent's CID and
    parentFileNameHint its name; reads go through to the parent, writes stay in
    the delta."""
    for d in ("qemu", "ours"):
        (workdir / d).mkdir()
        helpers.qemu_img("create", "-q", "-f", "vmdk", workdir / d / "base.vmdk", "3M")
        helpers.qemu_io(workdir / d / "base.vmdk", "write -P 0x66 0 1M", fmt="vmdk")
    theirs, ours = ch.create_side_by_side(workdir, "vmdk", ["-b", "base.vmdk", "-F", "vmdk"], "d.vmdk")
    blank_parent = [re.sub(rb"parentCID=[0-9a-f]+", b"parentCID=", t) for t in (vmdk_parts(ours)[1], vmdk_parts(theirs)[1])]
    assert blank_parent[0] == blank_parent[1] and vmdk_parts(ours)[2] == vmdk_parts(theirs)[2]
    info = ch.assert_same_info(theirs, ours, "vmdk", ignore=["cid", "parent-cid"])
    assert info["virtual-size"] == 3 * MiB and info["backing-filename"] == "base.vmdk"
    base_cid = helpers.qemu_img_info(workdir / "ours" / "base.vmdk", fmt="vmdk")["format-specific"]["data"]["cid"]
    assert helpers.qemu_img_info(ours, fmt="vmdk")["format-specific"]["data"]["parent-cid"] == base_cid
    helpers.qemu_img_check(ours, fmt="vmdk")
    helpers.run(["qemu-img", "compare", "-f", "vmdk", "-F", "vmdk", workdir / "ours" / "base.vmdk", ours])
    base_sum = helpers.sha256_file(workdir / "ours" / "base.vmdk")
    with helpers.mounted(ours, workdir / "view.raw", ["rw"]) as m:
        with open(m.path, "r+b") as f:
            f.seek(512 * KiB)
            f.write(b"\x77" * 4096)
    assert helpers.sha256_file(workdir / "ours" / "base.vmdk") == base_sum
    expected = helpers.convert_to_raw(workdir / "ours" / "base.vmdk", workdir / "expected.raw", fmt="vmdk")
    with open(expected, "r+b") as f:
        f.seek(512 * KiB)
        f.write(b"\x77" * 4096)
    helpers.run(["qemu-img", "compare", "-f", "raw", "-F", "vmdk", expected, ours])
    helpers.qemu_img_check(ours, fmt="vmdk")


CREATE_REFUSALS = [
    ["-o", "subformat=monolithicflat"],
    ["-o", "adapter_type=scsi"],
    ["-o", "compat6=on,hwversion=7"],
    ["-o", "subformat=monolithicFlat,zeroed_grain=on"],
    ["-o", "subformat=twoGbMaxExtentFlat", "-b", "base.vmdk", "-F", "vmdk"],
    ["-b", "base.raw", "-F", "raw"],
    ["-o", "preallocation=metadata"],
    ["-o", "nosuchoption=1"],
    ["-o", "compat6=maybe"],
    [],  # no size
]


def test_create_refusals_like_qemu_img(workdir: Path) -> None:
    for d in ("qemu-refused", "ours-refused"):
        (workdir / d).mkdir()
        helpers.qemu_img("create", "-q", "-f", "vmdk", workdir / d / "base.vmdk", "1M")
        helpers.qemu_img("create", "-q", "-f", "raw", workdir / d / "base.raw", "1M")
    for args in CREATE_REFUSALS:
        theirs, ours = ch.refused_like_qemu_img(workdir, "vmdk", args, "x.vmdk", "1M" if args else None)
        if "nosuchoption=1" in args:  # qcowfs's option parser names the format too
            assert ours.startswith("Invalid parameter 'nosuchoption'"), ours
        else:
            assert ours == theirs, args
