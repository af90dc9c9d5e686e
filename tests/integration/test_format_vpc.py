"""VHD (qemu's "vpc") images read through a read-only mount, refereed by QEMU
(format_helpers.check_image): dynamic disks of sizes that are and are not
CHS-exact (the virtual size is the CHS geometry's), force_size=on (creator
"qem2": the footer's current_size), fixed disks (named with format=vpc: QEMU
probes them as raw), scattered data, a differencing disk (QEMU 7.2 reads it as
a dynamic disk without its parent), a qcow2 overlay over a VHD base, and a
refused read-write mount."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from qcowfs_testlib import create_helpers as ch
from qcowfs_testlib import helpers
from qcowfs_testlib.format_helpers import KiB, MiB, check_image, check_image_direct, make_image, scattered_writes

BLOCK = 2 * MiB  # qemu-img's VHD block size

VARIANTS = {
    # name: (create options, requested size)
    "dynamic_8m": ("", 8 * MiB),
    "dynamic_63m": ("", 63 * MiB),     # not CHS-exact: rounded up to 66080768
    "dynamic_100m": ("", 100 * MiB),   # not CHS-exact: 104865792
    "force_size_63m": ("force_size=on", 63 * MiB),
    "fixed_63m": ("subformat=fixed", 63 * MiB),
    "fixed_force_size": ("subformat=fixed,force_size=on", 24 * MiB),
}


def qemu_size(image: Path, fmt: str = "vpc") -> int:
    import json
    return json.loads(helpers.qemu_img("info", "--output=json", "-f", fmt, str(image)))["virtual-size"]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_reads_as_qemu_reads_it(workdir: Path, name: str) -> None:
    opts, size = VARIANTS[name]
    image = make_image(workdir, "vpc", f"{name}.vhd", size, opts)
    helpers.qemu_io(image, *scattered_writes(qemu_size(image), BLOCK), fmt="vpc")
    check_image(image, workdir, fmt="vpc")


def assert_probed_mount_matches(image: Path, workdir: Path) -> None:
    """A dynamic disk probes as vpc (the footer copy at 0): mounted without format=."""
    reference = helpers.convert_to_raw(image, workdir / f"{image.name}.probed.raw", fmt="vpc")
    with helpers.mounted(image, workdir / f"{image.name}.probed.view") as m:
        assert helpers.files_equal(m.path, reference)
    reference.unlink()


def test_fresh_dynamic_disk(workdir: Path) -> None:
    image = make_image(workdir, "vpc", "fresh.vhd", 16 * MiB)
    check_image(image, workdir, fmt="vpc")
    assert_probed_mount_matches(image, workdir)


def test_dynamic_probed_with_scattered_data_direct(workdir: Path) -> None:
    image = make_image(workdir, "vpc", "direct.vhd", 32 * MiB)
    helpers.qemu_io(image, *scattered_writes(qemu_size(image), BLOCK, seed=7), fmt="vpc")
    check_image(image, workdir, fmt="vpc")
    check_image_direct(image, workdir, fmt="vpc")
    assert_probed_mount_matches(image, workdir)


def test_chs_rounding_sizes(workdir: Path) -> None:
    """qemu-img rounds the size up to a CHS geometry; we show what QEMU shows."""
    for size in (63 * MiB, 100 * MiB, 1 << 30):
        image = make_image(workdir, "vpc", f"chs{size}.vhd", size, cmds=[f"write -P 0x5a {size - 4096} 4096"])
        assert qemu_size(image) >= size
        ours = helpers.run([helpers.qcowfs_bin(), "info", "--json", str(image)]).stdout
        assert f'"virtual-size": {qemu_size(image)}'.encode() in ours


def footer_patch(image: Path, off: int, fmt: str, value) -> None:
    """Patches the footer at `off` and fixes its checksum."""
    with open(image, "r+b") as f:
        f.seek(off)
        b = bytearray(f.read(512))
        struct.pack_into(fmt, b, value[0], *value[1:])
        b[64:68] = b"\0\0\0\0"
        struct.pack_into(">I", b, 64, (~sum(b)) & 0xFFFFFFFF)
        f.seek(off)
        f.write(b)


def test_differencing_disk_reads_as_dynamic(workdir: Path) -> None:
    image = make_image(workdir, "vpc", "diff.vhd", 16 * MiB, cmds=["write -P 0x33 1M 64k"])
    for off in (0, image.stat().st_size - 512):
        footer_patch(image, off, ">I", (60, 4))  # type: differencing
    check_image(image, workdir, fmt="vpc")


@pytest.mark.parametrize("creator", [b"win ", b"vpc ", b"tap\0"])
def test_creator_app_decides_the_size(workdir: Path, creator: bytes) -> None:
    """current_size (63 MiB exactly) for "win " and "tap\\0", the CHS geometry for "vpc "."""
    image = make_image(workdir, "vpc", "creator.vhd", 63 * MiB, cmds=["write -P 0x44 0 64k"])
    for off in (0, image.stat().st_size - 512):
        footer_patch(image, off, ">4s", (28, creator))
        footer_patch(image, off, ">Q", (48, 63 * MiB))
    expected = 63 * MiB if creator != b"vpc " else 66080768
    assert qemu_size(image) == expected
    check_image(image, workdir, fmt="vpc")


def test_qcow2_overlay_over_vhd_base(workdir: Path) -> None:
    base = make_image(workdir, "vpc", "base.vhd", 16 * MiB)
    helpers.qemu_io(base, *scattered_writes(qemu_size(base), BLOCK, seed=3), fmt="vpc")
    top = workdir / "top.qcow2"
    helpers.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", base.name, "-F", "vpc", str(top)])
    helpers.qemu_io(top, "write -P 0x77 1M 64k", "write -z 4M 64k", fmt="qcow2")
    reference = helpers.convert_to_raw(top, workdir / "top.ref.raw", fmt="qcow2")
    with helpers.mounted(top, workdir / "view.raw") as m:
        assert helpers.files_equal(m.path, reference)
    check_image(top, workdir, fmt="qcow2")


def test_read_write_mount_of_a_differencing_disk_is_refused(workdir: Path) -> None:
    """Fixed and dynamic disks are read-write (test_rw_formats.py); differencing ones not (QEMU
    would write them without their parent)."""
    image = make_image(workdir, "vpc", "rw.vhd", 8 * MiB, cmds=["write -P 0x12 0 4k"])
    for off in (0, image.stat().st_size - 512):
        footer_patch(image, off, ">I", (60, 4))  # type: differencing
    before = helpers.sha256_file(image)
    code, text = helpers.mount_fails(image, workdir / "view", ["rw"])
    assert code != 0 and "differencing" in text and "read-only" in text, text
    assert helpers.sha256_file(image) == before


def test_footer_copy_saying_fixed_reads_as_fixed(workdir: Path) -> None:
    """A dynamic layout whose footer at 0 says fixed: QEMU parses the dynamic
    header, then reads the file as a fixed disk (the footer copy first)."""
    image = make_image(workdir, "vpc", "mixed.vhd", 8 * MiB, cmds=["write -P 0x66 0 64k"])
    footer_patch(image, 0, ">I", (60, 2))
    check_image(image, workdir, fmt="vpc")


# ---- qcowfs create -f vpc, refereed by qemu-img create 7.2 ----

# name: (options, size, the expected virtual size qemu-img info reports)
CREATE_VARIANTS = {
    "dynamic_chs_rounded": ([], "10M", 10514432),
    "dynamic_tiny": ([], "1000", 34816),            # 2 sectors round up to 4 x 17 sectors
    "dynamic_force_size": (["-o", "force_size=on,preallocation=full"], "1000", 1024),
    "fixed_chs_rounded": (["-o", "subformat=fixed"], "63M", 66080768),
    "fixed_force_size": (["-o", "subformat=fixed,force_size=on"], "5M", 5 * MiB),
}
# The footer's random or time-dependent fields: timestamp, checksum, UUID.
FOOTER_VARIABLE = [(24, 28), (64, 84)]


def blank_footers(data: bytes, footers: list[int]) -> bytes:
    b = bytearray(data)
    for at in footers:
        assert b[at:at + 8] == b"conectix"
        for lo, hi in FOOTER_VARIABLE:
            b[at + lo:at + hi] = bytes(hi - lo)
    return bytes(b)


@pytest.mark.parametrize("name", sorted(CREATE_VARIANTS))
def test_create_matches_qemu_img(workdir: Path, name: str) -> None:
    """The same file as qemu-img's, byte for byte but for each footer's timestamp,
    checksum and UUID; the same qemu-img info (the CHS-rounded size); a write
    through a read-write mount lands where qemu-img compare expects it."""
    opts, size, virtual_size = CREATE_VARIANTS[name]
    theirs, ours = ch.create_side_by_side(workdir, "vpc", opts, "d.vhd", size)
    assert ours.stat().st_size == theirs.stat().st_size
    fixed = "subformat=fixed" in "".join(opts)
    footers = [ours.stat().st_size - 512] + ([] if fixed else [0])
    with open(theirs, "rb") as t, open(ours, "rb") as o:  # a fixed disk: its data ranges, then the footer
        n = 512 if fixed else ours.stat().st_size
        start = ours.stat().st_size - n
        assert blank_footers(helpers.read_exact(o, start, n), [f - start for f in footers]) == \
            blank_footers(helpers.read_exact(t, start, n), [f - start for f in footers])
    assert helpers.data_extents(ours) == [(footers[0] if fixed else 0, ours.stat().st_size)]  # a fixed disk's data: a hole
    info = ch.assert_same_info(theirs, ours, "vpc")
    assert info["virtual-size"] == virtual_size
    mid = virtual_size // 2 - 100
    ch.write_through_rw_mount(ours, "vpc", workdir, [(0, b"\x21" * 512), (mid, b"\x42" * min(5000, virtual_size - mid))])


def test_create_refusals_like_qemu_img(workdir: Path) -> None:
    for d in ("qemu-refused", "ours-refused"):
        (workdir / d).mkdir()
        helpers.qemu_img("create", "-q", "-f", "vpc", workdir / d / "base.vhd", "1M")
    for args, size in ((["-o", "subformat=foo"], "1M"), (["-o", "preallocation=metadata"], "1M"), ([], "2041G"),
                       (["-o", "force_size=on"], "2041G"), (["-b", "base.vhd", "-F", "vpc"], "1M"), ([], None)):
        theirs, ours = ch.refused_like_qemu_img(workdir, "vpc", args, "x.vhd", size)
        assert ours == theirs, args
    theirs, ours = ch.refused_like_qemu_img(workdir, "vpc", ["-o", "force_size=maybe"], "x.vhd", "1M")
    assert ours == theirs

