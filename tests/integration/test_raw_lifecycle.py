"""qcowfs process lifecycle on raw images: SIGTERM during a write load loses
no acknowledged write, signals and external unmounts end the process cleanly
and quickly, bad command lines are refused with a message, --help/--version."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qcowfs_testlib import helpers

MiB = 1 << 20
BLOCK = 64 * 1024
SLOTS = 512  # 32 MiB of distinct blocks

# Writes distinct blocks from 4 threads and prints "<slot> <generation>" after
# each pwrite returned (the write was acknowledged); stops at the first error.
WRITER = r"""
import os, sys, threading
path, slots, block = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
fd = os.open(path, os.O_WRONLY)
lock = threading.Lock()
def pattern(slot, gen):
    head = f"slot {slot:6d} gen {gen:8d} ".encode()
    return (head * (block // len(head) + 1))[:block]
def run(first):
    gen = 0
    try:
        while True:
            gen += 1
            for slot in range(first, slots, 4):
                os.pwrite(fd, pattern(slot, gen), slot * block)
                if slot % 16 == first:
                    os.fsync(fd)
                with lock:
                    sys.stdout.write(f"{slot} {gen}\n")
                    sys.stdout.flush()
    except OSError as e:
        with lock:
            sys.stdout.write(f"stopped {e.errno}\n")
            sys.stdout.flush()
threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
for t in threads: t.start()
for t in threads: t.join()
"""


def pattern(slot: int, gen: int) -> bytes:
    head = f"slot {slot:6d} gen {gen:8d} ".encode()
    return (head * (BLOCK // len(head) + 1))[:BLOCK]


def wait_exit(proc: subprocess.Popen, timeout: float) -> tuple[int, float]:
    start = time.monotonic()
    code = proc.wait(timeout=timeout)
    return code, time.monotonic() - start


def test_sigterm_under_write_load_keeps_acknowledged_writes(workdir: Path) -> None:
    image = workdir / "disk.raw"
    with open(image, "wb") as f:
        f.truncate(SLOTS * BLOCK)
    with helpers.mounted(image, workdir / "view", ["rw", "queues=2"]) as m:
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(m.path), str(SLOTS), str(BLOCK)],
                                  stdout=subprocess.PIPE, text=True)
        try:
            seen = []
            while len(seen) < 300:  # let it run into the second generation of some slots
                line = writer.stdout.readline()
                assert line and not line.startswith("stopped"), f"writer ended early: {line!r}"
                seen.append(line.strip())
            m.proc.send_signal(signal.SIGTERM)
            code, took = wait_exit(m.proc, helpers.EXIT_TIMEOUT_S)
            rest, _ = writer.communicate(timeout=30)
        finally:
            if writer.poll() is None:
                writer.kill()
        assert code == 0, f"qcowfs exited {code} after SIGTERM\n{m.stderr()}"
        assert took < 2.0, f"qcowfs took {took:.2f}s to exit after SIGTERM"
        assert not helpers.is_fuse_mounted(m.target)
    lines = seen + [l for l in rest.splitlines() if l]
    assert any(l.startswith("stopped") for l in lines), "the writer never saw the mount go away"
    latest: dict[int, int] = {}
    # Every slot's last acknowledged generation (or a later, unacknowledged one) is on disk.
    all_lines = [l for l in lines if not l.startswith("stopped")]
    for l in all_lines:
        slot, gen = map(int, l.split())
        latest[slot] = max(latest.get(slot, 0), gen)
    assert len(latest) > 100
    with open(image, "rb") as f:
        for slot, gen in latest.items():
            got = os.pread(f.fileno(), BLOCK, slot * BLOCK)
            ok = [pattern(slot, g) for g in (gen, gen + 1)]
            assert got in ok, f"slot {slot}: acknowledged generation {gen} lost; found {got[:32]!r}"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_signal_exits_zero_and_unmounts(workdir: Path, sig: signal.Signals) -> None:
    image = workdir / "disk.raw"
    image.write_bytes(os.urandom(MiB))
    with helpers.mounted(image, workdir / "view", ["rw"]) as m:
        assert helpers.files_equal(m.path, image)
        m.proc.send_signal(sig)
        code, took = wait_exit(m.proc, helpers.EXIT_TIMEOUT_S)
        assert code == 0, m.stderr()
        assert took < 2.0, f"{took:.2f}s to exit"
        assert not helpers.is_fuse_mounted(m.target)


@pytest.mark.parametrize("tool", [["fusermount3", "-u"], ["umount"]], ids=["fusermount3", "umount"])
def test_external_unmount_ends_the_process(workdir: Path, tool: list[str]) -> None:
    image = workdir / "disk.raw"
    image.write_bytes(os.urandom(MiB))
    mnt = workdir / "mnt"
    mnt.mkdir()
    with helpers.mounted(image, mnt, ["rw"]) as m:
        with open(m.path, "r+b", buffering=0) as f:
            f.write(b"written before the unmount")
        helpers.run([*tool, str(mnt)])
        code, took = wait_exit(m.proc, helpers.EXIT_TIMEOUT_S)
        assert code == 0, m.stderr()
        assert took < 3.0, f"{took:.2f}s to exit after the unmount"
    assert image.read_bytes().startswith(b"written before the unmount")


def test_daemon_exits_after_external_unmount(workdir: Path) -> None:
    image = workdir / "disk.raw"
    image.write_bytes(os.urandom(MiB))
    with helpers.mounted(image, workdir / "view", foreground=False) as m:
        assert m.daemon_pids
        pids = list(m.daemon_pids)
    assert not any(helpers.pid_alive(p) for p in pids)  # mounted() unmounted and waited


@pytest.mark.parametrize("opts,mention", [
    (["bogus"], "bogus"),
    (["cache=fast"], "cache"),
    (["aio=posix"], "aio"),
    (["queues=0"], "queues"),
    (["format=vhd"], "vhd"),
    (["discard=yes"], "discard"),
    (["l2_cache_size=lots"], "l2_cache_size"),
    (["snapshot=s1", "rw"], "snapshot"),
])
def test_bad_options_are_refused(workdir: Path, opts: list[str], mention: str) -> None:
    image = workdir / "disk.raw"
    image.write_bytes(b"\0" * MiB)
    code, text = helpers.mount_fails(image, workdir / "view", opts)
    assert code == 1
    assert mention in text, text


def test_raw_image_has_no_snapshot_to_mount(workdir: Path) -> None:
    image = workdir / "disk.raw"
    image.write_bytes(b"\0" * MiB)
    code, text = helpers.mount_fails(image, workdir / "view", ["snapshot=s1"])
    assert "snapshot" in text


def test_help_and_version(qcowfs: str) -> None:
    h = helpers.run([qcowfs, "--help"]).stdout.decode()
    for word in ("IMAGE MOUNTPOINT", "cache=", "aio=", "queues=", "format=", "discard=", "snapshot=",
                 "allow_other", "-f", "-d"):
        assert word in h
    v = helpers.run([qcowfs, "--version"]).stdout.decode()
    assert v.startswith("qcowfs ") and "libfuse" in v
    p = helpers.run([qcowfs], check=False)
    assert p.returncode == 1 and b"IMAGE and MOUNTPOINT" in p.stderr
