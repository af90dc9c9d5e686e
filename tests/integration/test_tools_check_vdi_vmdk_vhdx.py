"""`qcowfs check [-r leaks|all]` of VDI, VMDK, VHDX and VHD images against `qemu-img check`.

qemu-img is the referee everywhere: for each image both tools run with the same
arguments, and the exit code, the --output=json report (every field but the
file name) and the "ERROR ..." / "Leaked ..." / "Repairing ..." lines on stderr
must be the same. Where qemu-img refuses to open an image, qcowfs must fail
with exit 1 and a message, no report and no crash. Images: clean ones made by
qemu-img with several options, the hostile corpus of each format
(tests/qcowfs_testlib/hostile_<fmt>.py), and images left by a kill -9 of a read-write
mount in the middle of writes, or by a simulated unclean stop; after a repair
by qcowfs, qemu-img check must agree with the result (clean where QEMU repairs).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from qcowfs_testlib import format_helpers as fh
from qcowfs_testlib import helpers


from qcowfs_testlib import hostile

MiB = 1 << 20
# stderr lines both tools print for what they find and repair.
FINDING_PREFIXES = ("ERROR", "Leaked", "Repairing", "Rebuilding", "VHDX")
MOUNT_TIMEOUT_S = 20  # generous: the machine running the suite is loaded
POOL = 6  # cases built and checked at once


def run_check(tool: list[str], image: Path, fmt: str, extra: tuple[str, ...]) -> tuple[int, dict, list[str], str]:
    proc = helpers.run([*tool, "-f", fmt, *extra, image], check=False)
    out, err = proc.stdout.decode(), proc.stderr.decode(errors="replace")
    report = json.loads(out) if out.strip() else {}
    report.pop("filename", None)
    findings = [line.removeprefix("qemu-img: ") for line in err.splitlines()]
    findings = [line for line in findings if line.startswith(FINDING_PREFIXES)]
    return proc.returncode, report, findings, err


def qemu_check(image: Path, fmt: str, *extra: str):
    return run_check(["qemu-img", "check", "--output=json"], image, fmt, extra)


def our_check(image: Path, fmt: str, *extra: str):
    return run_check([helpers.qcowfs_bin(), "check", "--json"], image, fmt, extra)


def assert_agree(image: Path, fmt: str, *extra: str) -> tuple[int, dict]:
    """Both tools on the same image (each on its own copy when repairing, so
    that both repair the same damage); returns qemu-img's exit code and report."""
    theirs_img = image
    if extra:
        theirs_img = image.with_name("qemu-" + image.name)
        helpers.run(["cp", "--sparse=always", image, theirs_img])
    rc, report, findings, err = qemu_check(theirs_img, fmt, *extra)
    ours_rc, ours, our_findings, our_err = our_check(image, fmt, *extra)
    assert ours_rc == rc, f"exit {ours_rc}, qemu-img {rc}\nours: {our_err}\nqemu-img: {err}"
    if not report and rc == 1:  # qemu-img could not open the image
        assert not ours and "qcowfs check:" in our_err, our_err
        assert "Segmentation" not in our_err and "Abort" not in our_err, our_err
    assert ours == report, f"ours: {ours}\nqemu-img: {report}"
    assert our_findings == findings, f"ours: {our_err}\nqemu-img: {err}"
    return rc, report


def kill9_mid_write(image: Path, fmt: str, workdir: Path) -> None:
    """A read-write mount of image, killed with SIGKILL while a writer is
    filling the disk with 64 KiB writes (some fsynced before)."""
    view = workdir / "view.raw"
    view.touch()
    proc = subprocess.Popen([helpers.qcowfs_bin(), "-f", "-o", f"rw,format={fmt}", image, view],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + MOUNT_TIMEOUT_S
        while not helpers.is_fuse_mounted(view):
            assert time.monotonic() < deadline and proc.poll() is None, "mount failed"
            time.sleep(0.05)
        fd = os.open(view, os.O_WRONLY)
        try:
            size = os.fstat(fd).st_size
            for off in range(0, size // 2, MiB):
                os.pwrite(fd, bytes([off // MiB + 1]) * (64 << 10), off)
            os.fsync(fd)
        finally:
            os.close(fd)
        writer = subprocess.Popen(["dd", "if=/dev/urandom", f"of={view}", "bs=64k", f"seek={size // 2 // 65536}",
                                   "conv=notrunc", f"count={size // 2 // 65536}"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.3)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        writer.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        helpers.run(["fusermount3", "-u", "-z", view], check=False)


def for_each(items, check) -> None:
    """check(item) for every item, a few at a time (the tools mostly wait on
    I/O), then fails naming every item whose check failed."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=POOL) as pool:
        futures = {item: pool.submit(check, item) for item in items}
    failed = {}
    for item, future in futures.items():
        try:
            future.result()
        except Exception as e:  # noqa: BLE001: reported below, with the item
            failed[item] = f"{type(e).__name__}: {e}"
    assert not failed, "\n\n".join(f"{item}: {why}" for item, why in failed.items())


def assert_refused(image: Path, fmt: str, pattern: str) -> None:
    """qcowfs check fails at open, with the corpus's refusal, exit 1 and no report."""
    rc, report, _, err = our_check(image, fmt)
    assert rc == 1 and not report, f"exit {rc}: {report} {err}"
    assert any(p.lower() in err.lower() for p in pattern.split("|")), err


def check_clean(fmt: str, variants: dict, workdir: Path) -> None:
    """Images made by qemu-img, one per variant (create options, qemu-io
    commands[, made by qemu-img convert]): both tools find them clean."""
    def one(variant: str) -> None:
        opts, cmds, *stream = variants[variant]
        d = workdir / variant
        d.mkdir()
        image = fh.make_image(d, fmt, f"c.{fmt}", 8 * MiB, opts, cmds, stream=bool(stream and stream[0]))
        assert assert_agree(image, fmt)[0] == 0
    for_each(variants, one)


def build_case(name: str, workdir: Path) -> Path:
    d = workdir / name
    d.mkdir()
    return hostile.build(name, d).image


def check_hostile_corpus(prefix: str, fmt: str, workdir: Path, refused: dict[str, int | None]) -> None:
    """Every case of the corpus: qcowfs check agrees with qemu-img check, but
    for the cases in `refused` (qcowfs refuses to open them, as its mount
    does; the value is qemu-img check's exit code there, None where qemu-img
    does not finish), where qcowfs must fail with the corpus's refusal."""
    names = [n for n in hostile.CASES if n.startswith(prefix)]
    assert len(names) >= 5 and set(refused) <= set(names), names

    def one(name: str) -> None:
        image = build_case(name, workdir)
        if name not in refused:
            assert_agree(image, fmt)
            return
        assert_refused(image, fmt, hostile.CASES[name].outcome.pattern)
        if refused[name] is not None:
            assert qemu_check(image, fmt)[0] == refused[name]
    for_each(names, one)


# ---------------------------------------------------------------- VDI
# QEMU 7.2's vdi_co_check: block map entries out of range or naming a data
# block twice, and a blocks_allocated that differs from the entries counted,
# are corruptions. No repair: with -r, "This image format does not support
# checks" and exit 63 (and nothing written).

VDI_CLEAN = {
    "empty": ("", ()),
    "dynamic": ("", ("write -P 1 0 2M", "write -P 2 5M 1M")),
    "static": ("static=on", ("write -P 3 1M 64k",)),
}


def test_vdi_clean(workdir: Path) -> None:
    check_clean("vdi", VDI_CLEAN, workdir)


def test_vdi_hostile_corpus(workdir: Path) -> None:
    check_hostile_corpus("vdi_", "vdi", workdir, {})


def test_vdi_blocks_allocated_mismatch_has_no_repair(workdir: Path) -> None:
    """What a stop between the block map and header writes leaves: the header
    counts one block less than the map names."""
    image = fh.make_image(workdir, "vdi", "u.vdi", 8 * MiB, "", ("write -P 1 0 3M",))
    with open(image, "r+b") as f:
        f.seek(388)  # blocks_allocated
        f.write((2).to_bytes(4, "little"))
    assert assert_agree(image, "vdi") == (2, {"corruptions": 1, "check-errors": 0, "format": "vdi"})
    before = helpers.sha256_file(image)
    for mode in ("leaks", "all"):
        assert assert_agree(image, "vdi", "-r", mode)[0] == 63
    assert helpers.sha256_file(image) == before


def test_vdi_kill9_mid_write(workdir: Path) -> None:
    image = fh.make_image(workdir, "vdi", "k.vdi", 8 * MiB)
    kill9_mid_write(image, "vdi", workdir)
    assert_agree(image, "vdi")
    assert assert_agree(image, "vdi", "-r", "all")[0] == 63


# ---------------------------------------------------------------- VMDK
# QEMU 7.2's vmdk_co_check walks the disk a grain at a time (a FLAT extent at
# once): the first grain at or past the end of its extent file (or a FLAT
# extent starting there) stops it with "ERROR: ..." and "Check failed:
# Invalid argument", exit 1 and no report; a guest offset past a grain
# directory with "Operation not permitted". No repair: -r gives exit 63.

VMDK_CLEAN = {
    "sparse": ("", ("write -P 1 0 1M", "write -P 2 5M 64k"), False),
    "sparse-zeroed-grain": ("zeroed_grain=on", ("write -P 1 64k 64k", "write -z 1M 1M"), False),
    "stream": ("subformat=streamOptimized", ("write -P 3 0 192k", "write -P 4 7M 64k"), True),
    "flat": ("subformat=monolithicFlat", ("write -P 5 1M 1M",), False),
    "split-sparse": ("subformat=twoGbMaxExtentSparse", ("write -P 6 2M 64k",), False),
}
VMDK_REFUSED = {
    "vmdk_capacity_absurd": 1,  # qemu-img: "could not get cluster_offset for sector 0", Check failed
    "vmdk_compressed_grain_512m": 0,
    "vmdk_descriptor_too_large": 0,
    "vmdk_descriptor_without_extents": 0,
    "vmdk_extent_names_itself": 0,
    "vmdk_parent_cid_stale": 0,
    "vmdk_parent_is_itself": None,  # qemu-img check opens the parent chain without end
}


def test_vmdk_clean(workdir: Path) -> None:
    check_clean("vmdk", VMDK_CLEAN, workdir)


def test_vmdk_hostile_corpus(workdir: Path) -> None:
    check_hostile_corpus("vmdk_", "vmdk", workdir, VMDK_REFUSED)


def test_vmdk_flat_extent_past_the_end_of_its_file(workdir: Path) -> None:
    """A FLAT extent file cut to nothing: its start points after EOF."""
    image = fh.make_image(workdir, "vmdk", "f.vmdk", 8 * MiB, "subformat=monolithicFlat")
    os.truncate(workdir / "f-flat.vmdk", 0)
    assert assert_agree(image, "vmdk") == (1, {})


def test_vmdk_kill9_mid_write_then_repair_modes(workdir: Path) -> None:
    image = fh.make_image(workdir, "vmdk", "k.vmdk", 8 * MiB)
    kill9_mid_write(image, "vmdk", workdir)
    assert_agree(image, "vmdk")
    before = helpers.sha256_file(image)
    for mode in ("leaks", "all"):
        assert assert_agree(image, "vmdk", "-r", mode)[0] == 63
    assert helpers.sha256_file(image) == before


# ---------------------------------------------------------------- VHDX
# QEMU 7.2's vhdx_co_check counts what vhdx_check_bat_entries finds in every
# FULLY_PRESENT BAT entry (offset overflow, start or end past the end of the
# file, payload block overlapping the log or a region), each a corruption. A
# log that needs replay makes a read-only open fail (exit 1); -r leaks|all
# opens read-write, which replays it: one corruption fixed.

VHDX_CLEAN = {
    "dynamic": ("", ("write -P 1 0 1M", "write -P 2 5M 64k")),
    "fixed": ("subformat=fixed", ("write -P 3 1M 64k",)),
    "small-blocks": ("block_size=1M,log_size=1M", ("write -P 4 0 3M",)),
}
VHDX_REFUSED = {"vhdx_virtual_size_wraps_block_count": 0}


def test_vhdx_clean(workdir: Path) -> None:
    check_clean("vhdx", VHDX_CLEAN, workdir)


def test_vhdx_hostile_corpus(workdir: Path) -> None:
    check_hostile_corpus("vhdx_", "vhdx", workdir, VHDX_REFUSED)


def test_vhdx_truncated_blocks(workdir: Path) -> None:
    """A file cut inside its last block and before another: one block ends and
    one starts past the end of the file, two corruptions; -r repairs nothing."""
    image = fh.make_image(workdir, "vhdx", "t.vhdx", 8 * MiB, "block_size=1M",
                          ("write -P 1 0 1M", "write -P 2 1M 1M", "write -P 3 2M 1M"))
    os.truncate(image, os.path.getsize(image) - 3 * MiB // 2)
    rc, report = assert_agree(image, "vhdx")
    assert (rc, report.get("corruptions")) == (2, 2)
    assert assert_agree(image, "vhdx", "-r", "all") == (rc, report)


def test_vhdx_log_replay_by_repair(workdir: Path) -> None:
    pending = build_case("vhdx_log_needs_replay", workdir)
    for mode in ("leaks", "all"):
        image = workdir / f"{mode}.vhdx"
        helpers.run(["cp", pending, image])
        assert assert_agree(image, "vhdx") == (1, {})
        assert assert_agree(image, "vhdx", "-r", mode) == (0, {"corruptions-fixed": 1, "check-errors": 0,
                                                                "format": "vhdx"})
        helpers.qemu_img_check(image, "vhdx")
        # The replayed guest data: as qemu-img's replay of the same log left it.
        helpers.run(["qemu-img", "compare", "-q", "-f", "vhdx", "-F", "vhdx", image, workdir / f"qemu-{mode}.vhdx"])


def test_vhdx_kill9_mid_write_then_repair(workdir: Path) -> None:
    image = fh.make_image(workdir, "vhdx", "k.vhdx", 8 * MiB, "block_size=1M,log_size=1M")
    kill9_mid_write(image, "vhdx", workdir)
    assert_agree(image, "vhdx")
    assert_agree(image, "vhdx", "-r", "all")
    helpers.qemu_img_check(image, "vhdx")


# ---------------------------------------------------------------- VHD (vpc)
# QEMU 7.2's vpc driver has no check: "This image format does not support
# checks", exit 63, with and without -r.


def test_vpc_has_no_check_as_in_qemu(workdir: Path) -> None:
    image = fh.make_image(workdir, "vpc", "v.vhd", 8 * MiB, "", ("write -P 1 0 1M",))
    for extra in ((), ("-r", "all")):
        rc, report, findings, err = our_check(image, "vpc", *extra)
        assert rc == qemu_check(image, "vpc", *extra)[0] == 63, err
        assert not report and "does not support checks" in err, err
