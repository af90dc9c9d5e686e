"""Image locking against QEMU's own tools, through real mounts.

QEMU (file-posix) takes OFD locks on bytes 100+i (permissions held) and 200+i
(permissions not shared); qcowfs takes the same bytes (io/lock.h). Checked here
against qemu-img, qemu-io and qemu-storage-daemon exactly as they behave:
  * a read-only mount shares with readers (qemu-img info without -U works) but
    refuses writers (qemu-io write fails), like a read-only QEMU user;
  * a read-write mount refuses qemu-io writes and other mounts; on qcow2 it
    refuses qemu-img info without -U too (QEMU's qcow2 readers do not share
    "write"), while raw images let qemu-img info through, as QEMU's raw driver does;
  * an image held read-write by qemu-storage-daemon refuses our mounts, ro and
    rw, unless -o force-share (ro only) or -o locking=off;
  * backing files are locked read-only and never written.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from qcowfs_testlib import helpers

MiB = 1 << 20
LOCK_ERROR = r'Failed to get "write" lock'
SHARED_LOCK_ERROR = r'Failed to get shared "write" lock'
RW_FORMATS = ["raw", "qcow2"]


def make_image(workdir: Path, fmt: str, name: str | None = None) -> Path:
    img = workdir / (name or f"disk.{ 'qcow2' if fmt == 'qcow2' else 'img'}")
    helpers.qemu_img("create", "-q", "-f", fmt, img, "16M")
    helpers.qemu_io(img, "write -q -P 0x5a 0 1M", fmt=fmt)
    return img


def tool(*args) -> subprocess.CompletedProcess:
    return helpers.run(args, check=False, timeout=60)


def output(proc: subprocess.CompletedProcess) -> str:
    return (proc.stdout + proc.stderr).decode(errors="replace")


def qemu_io_write_refused(img: Path, fmt: str) -> str:
    proc = tool("qemu-io", "-f", fmt, "-c", "write -P 1 0 4k", img)
    text = output(proc)
    assert proc.returncode != 0 or "can't open" in text, f"qemu-io wrote to a locked image:\n{text}"
    assert re.search(LOCK_ERROR, text), text
    return text


@contextlib.contextmanager
def storage_daemon(img: Path, fmt: str, workdir: Path, writable: bool = True):
    """qemu-storage-daemon holding img (rw by default) through an NBD export on a unix socket."""
    sock = workdir / "qsd.sock"
    ro = "off" if writable else "on"
    args = ["qemu-storage-daemon",
            "--blockdev", f"driver=file,node-name=f,filename={img},read-only={ro}",
            "--blockdev", f"driver={fmt},node-name=d,file=f,read-only={ro}",
            "--nbd-server", f"addr.type=unix,addr.path={sock}",
            "--export", f"type=nbd,id=e,node-name=d,writable={'on' if writable else 'off'}"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not sock.exists():
            assert proc.poll() is None, f"qemu-storage-daemon failed: {proc.stderr.read().decode()}"
            assert time.monotonic() < deadline, "qemu-storage-daemon did not start"
            time.sleep(0.05)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            helpers.kill_group(proc.pid)
            proc.wait()


# --------------------------------------------------------------------------
# Read-only mounts


@pytest.mark.parametrize("fmt", ["qcow2", "raw"])
def test_read_only_mount_shares_with_readers_not_writers(fmt, workdir):
    img = make_image(workdir, fmt)
    with helpers.mounted(img, workdir / "view.raw", [f"format={fmt}"]):
        info = tool("qemu-img", "info", "-f", fmt, img)
        assert info.returncode == 0, output(info)
        assert tool("qemu-io", "-r", "-f", fmt, "-c", "read -P 0x5a 0 4k", img).returncode == 0
        qemu_io_write_refused(img, fmt)
    # Released at unmount.
    assert tool("qemu-io", "-f", fmt, "-c", "write -P 1 0 4k", img).returncode == 0


def test_two_read_only_mounts_coexist(workdir):
    img = make_image(workdir, "qcow2")
    with helpers.mounted(img, workdir / "a.raw") as a, helpers.mounted(img, workdir / "b.raw") as b:
        assert helpers.files_equal(a.path, b.path)


# --------------------------------------------------------------------------
# Read-write mounts


@pytest.mark.parametrize("fmt", RW_FORMATS)
def test_read_write_mount_refuses_qemu(fmt, workdir):
    img = make_image(workdir, fmt)
    with helpers.mounted(img, workdir / "view.raw", ["rw", f"format={fmt}"]):
        info = tool("qemu-img", "info", "-f", fmt, img)
        if fmt == "qcow2":
            # QEMU's qcow2 readers never share "write" on the file (metadata must
            # stay consistent): without -U, qemu-img info is refused, as against a running VM.
            assert info.returncode != 0 and re.search(SHARED_LOCK_ERROR, output(info)), output(info)
        else:
            # QEMU's raw driver passes sharing through: qemu-img info works, as against a VM.
            assert info.returncode == 0, output(info)
        forced = tool("qemu-img", "info", "-U", "-f", fmt, img)
        assert forced.returncode == 0, output(forced)
        qemu_io_write_refused(img, fmt)
        code, text = helpers.mount_fails(img, workdir / "second.raw", [f"format={fmt}"])
        assert re.search(r"lock", text, re.IGNORECASE), text
        # A second rw mount is refused naming the lock before it writes anything.
        before = helpers.sha256_file(img)
        code, text = helpers.mount_fails(img, workdir / "second.raw", ["rw", f"format={fmt}"])
        assert re.search(helpers.WRITE_LOCK_REFUSED, text, re.IGNORECASE), text
        assert helpers.sha256_file(img) == before


@pytest.mark.parametrize("fmt", RW_FORMATS)
def test_read_write_mount_refused_while_qemu_writes(fmt, workdir):
    img = make_image(workdir, fmt)
    with storage_daemon(img, fmt, workdir):
        before = helpers.sha256_file(img)
        code, text = helpers.mount_fails(img, workdir / "view.raw", ["rw", f"format={fmt}"])
        assert re.search(r'failed to get (shared )?"write" lock', text, re.IGNORECASE), text
        assert helpers.sha256_file(img) == before  # nothing written (no dirty bit) before the lock
    with helpers.mounted(img, workdir / "view.raw", ["rw", f"format={fmt}"]):
        pass


def test_writers_refused_before_touching_a_dirty_image_in_use(workdir, qcowfs):
    """qemu-io holds a lazy-refcounts image it has written (dirty bit set). A
    writer that opened it would repair the refcounts and clear the dirty bit at
    once; a rw mount and check -r are refused naming the lock, the file unchanged."""
    img = workdir / "dirty.qcow2"
    helpers.qemu_img("create", "-q", "-f", "qcow2", "-o", "lazy_refcounts=on", img, "16M")
    with helpers.qemu_io_holding(img) as holder:
        out = holder.command("write -P 1 0 64k")
        assert "wrote 65536/65536 bytes" in out, out
        assert qcow2_dirty(img)
        before = helpers.sha256_file(img)
        code, text = helpers.mount_fails(img, workdir / "view.raw", ["rw"])
        assert re.search(helpers.WRITE_LOCK_REFUSED, text, re.IGNORECASE), text
        assert helpers.sha256_file(img) == before
        proc = tool(qcowfs, "check", "-r", "all", img)
        assert proc.returncode == 1 and re.search(helpers.WRITE_LOCK_REFUSED, output(proc), re.IGNORECASE)
        assert helpers.sha256_file(img) == before
        assert qcow2_dirty(img)


def qcow2_dirty(img: Path) -> bool:
    with open(img, "rb") as f:
        f.seek(72)  # incompatible_features; bit 0: dirty
        return bool(int.from_bytes(f.read(8), "big") & 1)


@pytest.mark.parametrize("fmt", ["qcow2", "raw"])
def test_read_only_mount_refused_while_qemu_writes_unless_force_share(fmt, workdir):
    img = make_image(workdir, fmt)
    ref = helpers.convert_to_raw(img, workdir / "ref.raw", fmt=fmt)
    with storage_daemon(img, fmt, workdir):
        code, text = helpers.mount_fails(img, workdir / "view.raw", [f"format={fmt}"])
        assert re.search(r'shared "write" lock', text), text
        with helpers.mounted(img, workdir / "view.raw", ["force-share", f"format={fmt}"]) as m:
            assert helpers.files_equal(m.path, ref)


def test_force_share_needs_read_only(workdir):
    img = make_image(workdir, "raw")
    code, text = helpers.mount_fails(img, workdir / "view.raw", ["rw", "force-share", "format=raw"])
    assert re.search(r"force-share", text), text


def test_locking_off_takes_and_checks_nothing(workdir):
    img = make_image(workdir, "qcow2")
    with storage_daemon(img, "qcow2", workdir, writable=False):
        with helpers.mounted(img, workdir / "view.raw", ["locking=off"]):
            # No bytes taken by us: a writer could open it (we only test, not write).
            with open("/proc/locks") as f:
                ino = os.stat(img).st_ino
                ours = [l for l in f if f":{ino:d} " in l or f":{ino} " in l]
            # qemu-storage-daemon's read-only user holds exactly 3 bytes; we add none.
            assert len(ours) == 3, ours


def test_bad_locking_value_is_refused(workdir):
    img = make_image(workdir, "qcow2")
    code, text = helpers.mount_fails(img, workdir / "view.raw", ["locking=maybe"])
    assert re.search(r"locking", text), text


# --------------------------------------------------------------------------
# Backing files: locked for reading, never written


def test_backing_file_is_locked_read_only_and_unchanged(workdir):
    base = make_image(workdir, "qcow2", "base.qcow2")
    top = workdir / "top.qcow2"
    helpers.qemu_img("create", "-q", "-f", "qcow2", "-b", base.name, "-F", "qcow2", top, "16M")
    before = helpers.sha256_file(base), os.stat(base).st_mtime_ns
    with helpers.mounted(top, workdir / "view.raw") as m:
        qemu_io_write_refused(base, "qcow2")
        assert tool("qemu-img", "info", "-f", "qcow2", base).returncode == 0
        with open(m.path, "rb") as f:
            assert f.read(4096) == b"\x5a" * 4096
    assert (helpers.sha256_file(base), os.stat(base).st_mtime_ns) == before


# --------------------------------------------------------------------------
# Who may use the mount


@pytest.mark.parametrize("rw", [False, True])
def test_mounted_file_mode_and_owner(rw, workdir):
    img = make_image(workdir, "raw")
    opts = ["format=raw"] + (["rw"] if rw else [])
    with helpers.mounted(img, workdir / "view.raw", opts) as m:
        st = os.stat(m.path)
        assert st.st_uid == os.getuid() and st.st_gid == os.getgid()
        assert bool(st.st_mode & 0o200) == rw, oct(st.st_mode)
        assert not st.st_mode & 0o022, f"group/other may write: {oct(st.st_mode)}"
        with open("/proc/self/mountinfo") as f:
            line = next(l for l in f if f" {os.path.realpath(m.target)} " in l)
        assert "allow_other" not in line, f"allow_other is on by default: {line}"
