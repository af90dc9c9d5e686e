"""Stress: concurrent fio writers, trimmers, readers and fsyncs on a read-write
mount of a qcow2 overlay (extended L2, 64 KiB clusters / 2 KiB subclusters)
over a qcow2 backing file, then every check that can fail:
  * fio's own verification of everything its writers wrote (crc32c headers,
    verified while running and at the end) passes;
  * the daemon exits 0 at unmount (its final flush worked);
  * `qemu-img check` finds no corruption and no leak;
  * the backing file is bit-for-bit unchanged;
  * a fresh read-only mount shows exactly what `qemu-img convert` shows.

Duration: QCOWFS_STRESS_SECONDS (default 60). For a longer soak, e.g. ten
minutes with a bigger disk:
  QCOWFS_STRESS_SECONDS=600 QCOWFS_STRESS_SIZE_MIB=2048 \
    pytest-3 -q tests/integration/test_stress.py
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from qcowfs_testlib import helpers

MiB = 1 << 20
SECONDS = int(os.environ.get("QCOWFS_STRESS_SECONDS", "60"))
SIZE_MIB = int(os.environ.get("QCOWFS_STRESS_SIZE_MIB", "256"))


def job_file(path: Path, size_mib: int, seconds: int) -> str:
    """Four disjoint quarters: two verified writers, one trimmer over a writer-free
    quarter (with its own readers), one reader of backing-only data."""
    q = size_mib // 4
    return f"""
[global]
filename={path}
time_based=1
runtime={seconds}
group_reporting=1

[writer-a]
ioengine=psync
rw=randwrite
offset=0
size={q}M
bsrange=2k-128k
bs_unaligned=0
blockalign=2k
verify=crc32c
verify_backlog=64
verify_fatal=1
fsync=17
numjobs=1

[writer-b]
ioengine=psync
rw=randrw
rwmixread=40
offset={q}M
size={q}M
bssplit=4k/50:64k/30:256k/20
verify=crc32c
verify_backlog=32
verify_fatal=1
fdatasync=9

[trimmer]
ioengine=falloc
rw=randtrim
offset={2 * q}M
size={q}M
bsrange=2k-192k
blockalign=2k

[trim-writer]
ioengine=psync
rw=randwrite
offset={2 * q}M
size={q}M
bsrange=4k-64k
fsync=5

[reader]
ioengine=psync
rw=randread
offset={3 * q}M
size={q}M
bsrange=512-256k
numjobs=2
"""


def build_chain(workdir: Path) -> tuple[Path, Path]:
    base = workdir / "base.qcow2"
    top = workdir / "top.qcow2"
    size = f"{SIZE_MIB}M"
    helpers.qemu_img("create", "-q", "-f", "qcow2", base, size)
    # Backing data everywhere, so unallocated overlay ranges really read from it.
    helpers.qemu_io(base, *[f"write -q -P {0x10 + i} {i * SIZE_MIB // 8}M {SIZE_MIB // 16}M" for i in range(8)])
    helpers.qemu_img("create", "-q", "-f", "qcow2", "-o", "extended_l2=on,cluster_size=64k",
                     "-b", base.name, "-F", "qcow2", top, size)
    return base, top


def test_fio_mixed_workload_over_backing_chain(workdir):
    base, top = build_chain(workdir)
    base_sha = helpers.sha256_file(base)
    jobs = workdir / "stress.fio"
    with helpers.mounted(top, workdir / "view.raw", ["rw"]) as m:
        jobs.write_text(job_file(m.path, SIZE_MIB, SECONDS))
        proc = subprocess.run(["fio", "--output-format=terse", str(jobs)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, timeout=SECONDS + 600)
        text = (proc.stdout + proc.stderr).decode(errors="replace")
        assert proc.returncode == 0, f"fio failed (exit {proc.returncode}):\n{text[-4000:]}\n{m.stderr()}"
        assert "verify" not in proc.stderr.decode(errors="replace").lower(), text[-4000:]
        assert m.proc.poll() is None, "daemon died under load"
    helpers.qemu_img_check(top)
    assert helpers.sha256_file(base) == base_sha, "the backing file changed"
    ref = helpers.convert_to_raw(top, workdir / "ref.raw")
    with helpers.mounted(top, workdir / "check.raw") as m:
        assert helpers.files_equal(m.path, ref)
