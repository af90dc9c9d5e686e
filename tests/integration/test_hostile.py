"""Hostile and corrupt qcow2 images through a real mount (the corpus of tests/qcowfs_testlib/hostile.py).

For every case of the corpus, per its expected outcome:
  Refused   qcowfs exits non-zero before mounting, with a message naming the
            problem, without dying from a signal and with a small peak RSS;
  Eio       the mount works, every bad range fails with EIO, every good range
            reads what the pristine image held;
  Readable  the mount shows exactly what `qemu-img convert` shows.
Always: no hang (every step has a timeout, reads run in a child process), the
daemon's peak RSS (VmHWM) stays small, and no file of the image is changed
(sha256, size and mtime before and after).
Read-write mounts of inconsistent images follow QEMU's corrupt-bit rule: the
corrupt bit is set, writes fail with EIO, reads go on, nothing else changes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from qcowfs_testlib import helpers


from qcowfs_testlib import hostile

MiB = 1 << 20
# Peak resident memory allowed to the daemon: code, libraries, per-thread
# buffers and the small caches a 16 MiB image needs. An allocation driven by
# a hostile size field would blow far past it.
MAX_RSS_KIB = 96 * 1024
READ_TIMEOUT_S = 60

# Reads (offset, length) ranges of a file in a child process, so a hung FUSE
# request cannot hang the test: prints [{"errno": e} or {"data": hex sha256}].
READER = r"""
import hashlib, json, os, sys
path, ranges = sys.argv[1], json.loads(sys.argv[2])
fd = os.open(path, os.O_RDONLY)
out = []
for off, n in ranges:
    try:
        data = b""
        while len(data) < n:
            block = os.pread(fd, n - len(data), off + len(data))
            if not block:
                break
            data += block
        out.append({"data": hashlib.sha256(data).hexdigest(), "length": len(data)})
    except OSError as e:
        out.append({"errno": e.errno})
print(json.dumps(out))
"""


def read_ranges(path: Path, ranges) -> list[dict]:
    proc = subprocess.run([sys.executable, "-c", READER, str(path), json.dumps([list(r) for r in ranges])],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=READ_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    return json.loads(proc.stdout)


def sha_of(path: Path, off: int, n: int) -> str:
    import hashlib
    with open(path, "rb") as f:
        f.seek(off)
        return hashlib.sha256(f.read(n)).hexdigest()


def fingerprints(files: list[Path]) -> dict[str, tuple[str, int, int]]:
    return {str(f): (helpers.sha256_file(f), os.stat(f).st_mtime_ns, os.stat(f).st_size)
            for f in files if f.exists()}


def vm_hwm_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmHWM for pid {pid}")


def refused_with_rusage(image: Path, target: Path) -> tuple[int, str, int]:
    """Runs qcowfs -f on image; it must exit by itself. Returns (status, output, max RSS KiB)."""
    target.touch()
    argv = [helpers.qcowfs_bin(), "-f", str(image), str(target)]
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + helpers.MOUNT_TIMEOUT_S
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                proc.returncode = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                helpers.unmount(target)
                helpers.kill_group(proc.pid)
                proc.wait()
                raise AssertionError(f"qcowfs still running {helpers.MOUNT_TIMEOUT_S}s after start on {image}")
            time.sleep(0.02)
        log.seek(0)
        text = log.read().decode(errors="replace")
    mounted_anyway = helpers.is_fuse_mounted(target)
    if mounted_anyway:
        helpers.unmount(target)
    assert not mounted_anyway, f"qcowfs mounted {image} although it must refuse it:\n{text}"
    return proc.returncode, text, usage.ru_maxrss


def check_refused(case: hostile.Case, b: hostile.Built, workdir: Path) -> None:
    code, text, rss = refused_with_rusage(b.image, workdir / "view.raw")
    assert code > 0, f"qcowfs exited with {code} (negative: killed by signal {-code}):\n{text}"
    assert re.search(case.outcome.pattern, text, re.IGNORECASE), (
        f"message does not name the problem (/{case.outcome.pattern}/):\n{text}")
    assert rss < MAX_RSS_KIB, f"refusing the image peaked at {rss} KiB of RSS"


def check_eio(case: hostile.Case, b: hostile.Built, workdir: Path) -> None:
    outcome: hostile.Eio = case.outcome
    with helpers.mounted(b.image, workdir / "view.raw") as m:
        results = read_ranges(m.path, [*outcome.bad, *outcome.good])
        for (off, n), r in zip(outcome.bad, results):
            assert r.get("errno") == 5, f"read of [{off:#x}, +{n:#x}) gave {r}, expected EIO"
        for (off, n), r in zip(outcome.good, results[len(outcome.bad):]):
            assert "errno" not in r, f"read of good range [{off:#x}, +{n:#x}) failed: {r}"
            assert r == {"data": sha_of(b.pristine_raw, off, n), "length": n}, (
                f"good range [{off:#x}, +{n:#x}) differs from the pristine image")
        # The daemon keeps serving after the failures.
        again = read_ranges(m.path, outcome.good[:1])
        assert "errno" not in again[0], f"mount stopped serving after EIO: {again}"
        assert vm_hwm_kib(m.proc.pid) < MAX_RSS_KIB
        assert m.proc.poll() is None, "daemon died"
        assert re.search(r"corrupt|invalid|beyond|reserved|align", m.stderr(), re.IGNORECASE), (
            f"the daemon did not log the corruption:\n{m.stderr()}")


def check_readable(case: hostile.Case, b: hostile.Built, workdir: Path) -> None:
    ref = helpers.convert_to_raw(b.image, workdir / "ref.raw", fmt=b.extra.get("format"))
    with helpers.mounted(b.image, workdir / "view.raw") as m:
        size = os.path.getsize(ref)
        assert os.path.getsize(m.path) == size
        chunks = [(off, min(4 * MiB, size - off)) for off in range(0, size, 4 * MiB)]
        for (off, n), r in zip(chunks, read_ranges(m.path, chunks)):
            assert r == {"data": sha_of(ref, off, n), "length": n}, (
                f"[{off:#x}, +{n:#x}) differs from qemu-img convert: {r}")
        assert vm_hwm_kib(m.proc.pid) < MAX_RSS_KIB


CHECKS = {hostile.Refused: check_refused, hostile.Eio: check_eio, hostile.Readable: check_readable}


def test_corpus_is_large_enough():
    assert len(hostile.CASES) >= 30
    kinds = {type(c.outcome) for c in hostile.CASES.values()}
    assert kinds == set(CHECKS), kinds


@pytest.mark.parametrize("name", list(hostile.CASES))
def test_hostile_image(name, workdir):
    case = hostile.CASES[name]
    b = hostile.build(name, workdir / "case")
    before = fingerprints(b.files)
    CHECKS[type(case.outcome)](case, b, workdir)
    assert fingerprints(b.files) == before, "using the image changed its files"


@pytest.mark.parametrize("name", [n for n, c in hostile.CASES.items() if isinstance(c.outcome, hostile.Eio)][:3])
def test_hostile_image_under_concurrent_reads(name, workdir):
    """Many readers hitting a corrupt range at once: EIO for all, nothing stuck."""
    case = hostile.CASES[name]
    b = hostile.build(name, workdir / "case")
    with helpers.mounted(b.image, workdir / "view.raw") as m:
        procs = [subprocess.Popen([sys.executable, "-c", READER, str(m.path),
                                   json.dumps([list(r) for r in case.outcome.bad * 8])],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(6)]
        for p in procs:
            out, err = p.communicate(timeout=READ_TIMEOUT_S)
            assert p.returncode == 0, err.decode(errors="replace")
            assert all(r.get("errno") == 5 for r in json.loads(out)), out
        assert m.proc.poll() is None


def test_corrupt_image_refused_read_write(workdir):
    """An image with the corrupt bit set mounts read-only but never read-write."""
    img = hostile.plain(workdir)
    hostile.ed.set_field(img, "incompatible_features", 2)
    before = fingerprints([img])
    code, text = helpers.mount_fails(img, workdir / "view.raw", ["rw"])
    assert re.search(r"corrupt", text, re.IGNORECASE), text
    with helpers.mounted(img, workdir / "view.raw") as m:
        assert read_ranges(m.path, [(0, 4096)])[0]["length"] == 4096
        assert re.search(r"corrupt", m.stderr(), re.IGNORECASE), m.stderr()
    assert fingerprints([img]) == before



# --------------------------------------------------------------------------
# Read-write mounts of inconsistent images: QEMU's corrupt-bit rule


def file_without_incompat_field(path: Path) -> bytes:
    """The image's bytes with the incompatible-features field (the one field allowed to change) blanked."""
    data = bytearray(path.read_bytes())
    data[72:80] = bytes(8)
    return bytes(data)


def corrupt_bit(path: Path) -> bool:
    return bool(hostile.ed.get_field(path, "incompatible_features") & 2)


def test_write_onto_metadata_sets_corrupt_bit_and_stops_writes(workdir):
    """A guest cluster whose L2 entry points at the refcount table: writing it would
    destroy metadata. The write fails with EIO, the corrupt bit is set, later writes
    fail too, reads go on, and nothing but the header's feature field changed."""
    b = hostile.build("l2_entry_into_refcount_table", workdir / "case")
    before = file_without_incompat_field(b.image)
    with helpers.mounted(b.image, workdir / "view.raw", ["rw"], expect_exit=None) as m:
        fd = os.open(m.path, os.O_RDWR)
        try:
            with pytest.raises(OSError) as e:
                os.pwrite(fd, b"\xaa" * 4096, 64 * 1024)
            assert e.value.errno == 5
            with pytest.raises(OSError) as e:
                os.pwrite(fd, b"\xbb" * 4096, 8 * MiB)  # an innocent range: refused as well now
            assert e.value.errno == 5
            assert os.pread(fd, 4096, 4 * MiB) == b"\x02" * 4096
        finally:
            os.close(fd)
        assert re.search(r"corrupt", m.stderr(), re.IGNORECASE), m.stderr()
    assert corrupt_bit(b.image)
    assert file_without_incompat_field(b.image) == before, "metadata or data changed"
    code, text = helpers.mount_fails(b.image, workdir / "again.raw", ["rw"])
    assert re.search(r"corrupt", text, re.IGNORECASE), text


@pytest.mark.parametrize("name", ["reftable_entry_beyond_eof", "reftable_entry_into_l1", "l1_entry_into_l1_table"])
def test_inconsistent_metadata_refuses_read_write_and_marks_corrupt(name, workdir):
    b = hostile.build(name, workdir / "case")
    before = file_without_incompat_field(b.image)
    code, text = helpers.mount_fails(b.image, workdir / "view.raw", ["rw"])
    assert re.search(r"corrupt", text, re.IGNORECASE), text
    assert corrupt_bit(b.image)
    assert file_without_incompat_field(b.image) == before
    ref = helpers.convert_to_raw(b.image, workdir / "ref.raw", fmt=b.extra.get("format"))
    with helpers.mounted(b.image, workdir / "view.raw") as m:  # read-only still works
        assert helpers.files_equal(m.path, ref)
