"""Shared helpers for qcowfs integration tests.

Everything here talks to real tools: the built qcowfs binary, fusermount3 and
QEMU's qemu-img / qemu-io (the referee for what an image contains). Helpers
raise AssertionError (with the tool's stderr) when something goes wrong, so a
test failure explains itself.

Main entry points:
  qcowfs_bin()                      path of the binary under test
  mounted(image, target, opts=())   context manager: a live mount, unmounted after
  mount_fails(image, target, opts)  runs a mount that must be refused
  qemu_img(...), qemu_io(...)       wrappers raising with stderr on failure
  convert_to_raw(image)             reference raw file made by qemu-img convert
  files_equal(a, b)                 chunked comparison naming the first difference
  qemu_img_map(image)               `qemu-img map --output=json`
  qemu_img_check(image)             asserts no corruptions and no leaks
  data_extents(path)                data ranges seen through SEEK_DATA/SEEK_HOLE
  assert_map_agrees(map, extents)   compares qemu-img map with those ranges
  loop_device(path), host_fs_on_4k_device(dir)  loop devices, a 4096-byte-sector host fs

Not thread-safe in the sense of sharing one mount object between threads for
set-up/tear-down; reading a mounted file from many threads is fine.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import os
import select
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Sequence

REPO_ROOT = Path(__file__).resolve().parents[2]
MOUNT_TIMEOUT_S = 10.0
EXIT_TIMEOUT_S = 10.0
TOOL_TIMEOUT_S = 300.0
CHUNK = 1 << 20
QCOW2_MAGIC = b"QFI\xfb"
IMAGE_SUFFIXES = (".qcow2", ".img", ".raw", ".vmdk", ".vhdx", ".vhd", ".vdi", ".qed", ".hds", ".luks")


# --------------------------------------------------------------------------
# Locating the binary


def qcowfs_bin() -> str:
    """The binary under test: $QCOWFS_BIN, else build/qcowfs in the repo."""
    env = os.environ.get("QCOWFS_BIN")
    path = Path(env) if env else REPO_ROOT / "build" / "qcowfs"
    assert path.is_file() and os.access(path, os.X_OK), (
        f"qcowfs binary not found at {path} (build it, or set QCOWFS_BIN)")
    return str(path)


# --------------------------------------------------------------------------
# Running tools


def run(args: Sequence[str], *, check: bool = True, timeout: float = TOOL_TIMEOUT_S,
        input: bytes | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Runs a command, capturing output; raises with its stderr when check fails."""
    args = [str(a) for a in args]
    proc = subprocess.run(args, input=input, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"command failed with exit code {proc.returncode}: {' '.join(args)}\n"
            f"stdout: {proc.stdout.decode(errors='replace')}\n"
            f"stderr: {proc.stderr.decode(errors='replace')}")
    return proc


@functools.cache
def fast_kdf_calibration_env() -> dict[str, str]:
    """The environment for a qemu-img that creates a LUKS header (raw LUKS or
    qcow2's encrypt.format=luks) where the test does not test the key
    derivation: tests/support/fast_cpu_clock.c preloaded, so qemu-img's PBKDF2
    calibration takes one short round instead of 2-3 s of CPU per image
    (iter-time=10 does not shorten the calibration, only the iterations it then
    picks). The library is built with the tests: $QCOWFS_FAST_CPU_CLOCK (set by
    ctest), else tests/libqcowfs_fast_cpu_clock.so in $QCOWFS_BUILD_DIR or build/."""
    env = os.environ.get("QCOWFS_FAST_CPU_CLOCK")
    build = Path(os.environ.get("QCOWFS_BUILD_DIR") or REPO_ROOT / "build")
    lib = Path(env) if env else build / "tests" / "libqcowfs_fast_cpu_clock.so"
    assert lib.is_file(), f"{lib} not found (build the tests, or set QCOWFS_FAST_CPU_CLOCK)"
    return {**os.environ, "LD_PRELOAD": str(lib)}


def probe_format(image: str | os.PathLike) -> str:
    """'qcow2' if the file starts with the qcow2 magic, else 'raw'."""
    with open(image, "rb") as f:
        return "qcow2" if f.read(4) == QCOW2_MAGIC else "raw"


def qemu_img(*args) -> str:
    """Runs qemu-img with args; returns stdout as text, raises with stderr on failure."""
    return run(["qemu-img", *args]).stdout.decode()


def qemu_io(image: str | os.PathLike, *cmds: str, fmt: str | None = None,
            extra: Sequence[str] = ()) -> str:
    """Runs qemu-io commands (`-c CMD` each) on image; fmt defaults to the probed one.

    qemu-io reports some command errors on stdout with exit code 0, so its
    output is checked for them too.
    """
    fmt = fmt or probe_format(image)
    args = ["qemu-io", "-f", fmt, *extra]
    for c in cmds:
        args += ["-c", c]
    out = run([*args, image]).stdout.decode()
    for line in out.splitlines():
        low = line.lower()
        if "failed" in low or "error" in low or "invalid" in low:
            raise AssertionError(f"qemu-io reported an error: {line}\ncommand: {args}")
    return out


def convert_to_raw(image: str | os.PathLike, out: str | os.PathLike | None = None, *,
                   fmt: str | None = None, snapshot: str | None = None) -> Path:
    """Writes qemu-img's raw rendering of image (or of one internal snapshot) to out.

    out defaults to <image>.ref.raw (or <image>.<snapshot>.ref.raw). Returns its path.
    """
    image = Path(image)
    fmt = fmt or probe_format(image)
    if out is None:
        tag = f".{snapshot}" if snapshot else ""
        out = image.with_name(f"{image.name}{tag}.ref.raw")
    args = ["convert", "-f", fmt, "-O", "raw"]
    if snapshot is not None:
        args += ["-l", f"snapshot.name={snapshot}"]
    qemu_img(*args, image, out)
    return Path(out)


def qemu_img_info(image: str | os.PathLike, *, fmt: str | None = None) -> dict:
    fmt = fmt or probe_format(image)
    return json.loads(qemu_img("info", "--output=json", "-f", fmt, image))


def qemu_img_map(image: str | os.PathLike, *, fmt: str | None = None) -> list[dict]:
    """`qemu-img map --output=json` over the whole chain: a list of ranges."""
    fmt = fmt or probe_format(image)
    return json.loads(qemu_img("map", "--output=json", "-f", fmt, image))


def qemu_img_check(image: str | os.PathLike, fmt: str = "qcow2") -> dict:
    """Asserts `qemu-img check` finds no corruptions, leaks or check errors."""
    proc = run(["qemu-img", "check", "--output=json", "-f", fmt, image], check=False)
    text = proc.stdout.decode()
    try:
        report = json.loads(text)
    except json.JSONDecodeError:
        raise AssertionError(f"qemu-img check failed (exit {proc.returncode}): "
                             f"{text}{proc.stderr.decode(errors='replace')}") from None
    problems = {k: report.get(k, 0) for k in ("corruptions", "leaks", "check-errors")}
    assert proc.returncode == 0 and not any(problems.values()), (
        f"qemu-img check on {image}: exit {proc.returncode}, {problems}\n{text}")
    return report


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


# --------------------------------------------------------------------------
# Comparing content


def files_equal(a: str | os.PathLike, b: str | os.PathLike, *, length: int | None = None) -> bool:
    """Asserts a and b hold the same bytes (the first length bytes if given).

    Compares in 1 MiB chunks; the failure names the first differing offset and
    the bytes around it. Returns True so `assert files_equal(...)` reads well.
    """
    size_a, size_b = os.path.getsize(a), os.path.getsize(b)
    if length is None:
        assert size_a == size_b, f"size differs: {a} has {size_a} bytes, {b} has {size_b}"
        length = size_a
    else:
        assert size_a >= length and size_b >= length, (
            f"files shorter than {length}: {a}={size_a} {b}={size_b}")
    with open(a, "rb", buffering=0) as fa, open(b, "rb", buffering=0) as fb:
        off = 0
        while off < length:
            want = min(CHUNK, length - off)
            da, db = read_exact(fa, off, want), read_exact(fb, off, want)
            if da != db:
                i = first_difference(da, db)
                raise AssertionError(
                    f"{a} and {b} differ first at offset {off + i} (0x{off + i:x}): "
                    f"{da[i:i + 16].hex()} != {db[i:i + 16].hex()}")
            off += want
    return True


def read_exact(f, off: int, n: int) -> bytes:
    """pread of exactly n bytes (loops on short reads; fails on early EOF)."""
    parts, got = [], 0
    while got < n:
        block = os.pread(f.fileno(), n - got, off + got)
        assert block, f"unexpected EOF at offset {off + got} reading {f.name}"
        parts.append(block)
        got += len(block)
    return b"".join(parts)


def first_difference(a: bytes, b: bytes) -> int:
    lo, hi = 0, min(len(a), len(b))
    while hi - lo > 64:  # bisect on slices: fast in C, few Python steps
        mid = (lo + hi) // 2
        if a[lo:mid] != b[lo:mid]:
            hi = mid
        else:
            lo = mid
    for i in range(lo, min(len(a), len(b))):
        if a[i] != b[i]:
            return i
    return min(len(a), len(b))


# --------------------------------------------------------------------------
# Holes: SEEK_DATA / SEEK_HOLE against qemu-img map
#
# Agreement, precisely: let D be the set of byte ranges the mounted file
# reports as data (walking SEEK_DATA then SEEK_HOLE from 0 to EOF).
#  * every map range with "data": false and "zero": true (unallocated in the
#    whole chain, or a zero cluster) must not intersect D: it is a hole;
#  * every map range with "data": true and "zero": false must lie inside D;
#  * ranges with "data": true and "zero": true (preallocated clusters whose host
#    bytes are a hole) may be either: both renderings are correct.
# Content is checked separately, byte for byte, so the holes only have to be
# reported where they are, not proven to read as zeros here.


def data_extents(path: str | os.PathLike) -> list[tuple[int, int]]:
    """[start, end) ranges that SEEK_DATA/SEEK_HOLE report as data, in order."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        out, off = [], 0
        while off < size:
            try:
                start = os.lseek(fd, off, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:
                    break
                raise
            end = os.lseek(fd, start, os.SEEK_HOLE)
            assert start < end <= size and start >= off, (
                f"lseek out of order on {path}: from {off} data at {start} hole at {end}")
            out.append((start, end))
            off = end
        return out
    finally:
        os.close(fd)


def map_ranges(entries: Iterable[dict], *, data: bool, zero: bool) -> list[tuple[int, int]]:
    return [(e["start"], e["start"] + e["length"]) for e in entries
            if bool(e["data"]) == data and bool(e["zero"]) == zero]


def assert_map_agrees(entries: list[dict], extents: list[tuple[int, int]]) -> None:
    """Checks the agreement rule above; the message names the first offender."""
    for start, end in map_ranges(entries, data=False, zero=True):
        hit = overlap(extents, start, end)
        assert hit is None, (
            f"qemu-img map says [{start}, {end}) is a hole, but SEEK_DATA reports data "
            f"at [{hit[0]}, {hit[1]}); data extents: {summarise(extents)}")
    for start, end in map_ranges(entries, data=True, zero=False):
        gap = uncovered(extents, start, end)
        assert gap is None, (
            f"qemu-img map says [{start}, {end}) is data, but [{gap[0]}, {gap[1]}) is a "
            f"hole through SEEK_HOLE; data extents: {summarise(extents)}")


def overlap(extents: list[tuple[int, int]], start: int, end: int) -> tuple[int, int] | None:
    for s, e in extents:
        if s < end and start < e:
            return max(s, start), min(e, end)
    return None


def uncovered(extents: list[tuple[int, int]], start: int, end: int) -> tuple[int, int] | None:
    pos = start
    for s, e in extents:
        if e <= pos:
            continue
        if s > pos:
            return pos, min(s, end)
        pos = e
        if pos >= end:
            return None
    return (pos, end) if pos < end else None


def summarise(extents: list[tuple[int, int]], limit: int = 12) -> str:
    text = ", ".join(f"[{s}, {e})" for s, e in extents[:limit])
    return text + (f" ... ({len(extents)} in all)" if len(extents) > limit else "")


# --------------------------------------------------------------------------
# Mounts


def mountinfo_targets(fuse_only: bool = True) -> list[str]:
    """Mount points in /proc/self/mountinfo (only FUSE ones by default)."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fstype = right.split()[0] if right else ""
            if fuse_only and not fstype.startswith("fuse"):
                continue
            out.append(unescape_mountinfo(left.split()[4]))
    return out


def unescape_mountinfo(s: str) -> str:
    for code, ch in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        s = s.replace(code, ch)
    return s


def is_fuse_mounted(target: str | os.PathLike) -> bool:
    return os.path.realpath(target) in mountinfo_targets()


def raw_view_name(image: str | os.PathLike) -> str:
    """Name of the raw view in directory mode: image name without its suffix + .raw."""
    name = Path(image).name
    for suffix in IMAGE_SUFFIXES:
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)] + ".raw"
    return name + ".raw"


def unmount(target: str | os.PathLike) -> None:
    """fusermount3 -u, retrying while busy, then a lazy unmount as a last resort."""
    target = os.path.realpath(target)
    for _ in range(20):
        if not is_fuse_mounted(target):
            return
        if run(["fusermount3", "-u", target], check=False).returncode == 0:
            return
        time.sleep(0.1)
    run(["fusermount3", "-uz", target], check=False)


def find_pids(argv: Sequence[str]) -> list[int]:
    """Pids of live processes whose command line is exactly argv."""
    want = "\0".join(argv) + "\0"
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline") as f:
                if f.read() == want:
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


@dataclass
class Mount:
    """A live qcowfs mount. path is the raw view; proc the started process."""
    image: Path
    target: Path
    path: Path
    proc: subprocess.Popen
    argv: list[str]
    log_path: Path
    daemon_pids: list[int] = field(default_factory=list)
    final_log: str = ""  # everything the daemon wrote, read after it exited

    def stderr(self) -> str:
        """What the daemon wrote to stderr so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def snapshot_path(self, name: str) -> Path:
        """DIR/snapshots/<name>.raw (directory mode only)."""
        return self.target / "snapshots" / f"{name}.raw"


@contextlib.contextmanager
def mounted(image: str | os.PathLike, target: str | os.PathLike, opts: Sequence[str] = (), *,
            foreground: bool = True, expect_exit: int | None = 0,
            extra_args: Sequence[str] = ()) -> Iterator[Mount]:
    """Mounts image at target with qcowfs and yields a Mount.

    target may be a regular file (created empty if missing: the raw view
    replaces it) or a directory (the raw view is DIR/<name>.raw). opts are -o
    options joined with commas. On exit the mount is removed with fusermount3
    -u, the daemon must exit within EXIT_TIMEOUT_S with expect_exit (None: any
    code), else it is killed and the test fails.
    """
    image, target = Path(image), Path(target)
    if not target.exists():
        target.touch()
    argv = [qcowfs_bin(), *extra_args]
    if foreground:
        argv.append("-f")
    if opts:
        argv += ["-o", ",".join(opts)]
    argv += [str(image), str(target)]
    path = target / raw_view_name(image) if target.is_dir() else target
    log_fd, log_name = tempfile.mkstemp(prefix="qcowfs-", suffix=".log", dir=target.parent)
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd,
                            start_new_session=True)
    os.close(log_fd)
    m = Mount(image, target, path, proc, argv, Path(log_name))
    try:
        try:
            wait_for_mount(m, foreground)
        except BaseException:
            abandon_mount(m)
            raise
        try:
            yield m
        finally:
            try:
                finish_mount(m, foreground, expect_exit)
            finally:
                m.final_log = m.stderr()
    finally:
        with contextlib.suppress(OSError):
            os.unlink(m.log_path)


def wait_for_mount(m: Mount, foreground: bool) -> None:
    deadline = time.monotonic() + MOUNT_TIMEOUT_S
    while time.monotonic() < deadline:
        if is_fuse_mounted(m.target):
            if not foreground:
                wait_daemon_parent(m)
            return
        code = m.proc.poll()
        if code is not None and (foreground or code != 0):
            raise AssertionError(
                f"qcowfs exited with code {code} before mounting: {' '.join(m.argv)}\n"
                f"stderr:\n{m.stderr()}")
        time.sleep(0.02)
    raise AssertionError(f"no FUSE mount at {m.target} after {MOUNT_TIMEOUT_S}s: "
                         f"{' '.join(m.argv)}\nstderr:\n{m.stderr()}")


def wait_daemon_parent(m: Mount) -> None:
    """Daemon mode: the launching process exits 0 once mounted; find the daemon."""
    try:
        code = m.proc.wait(timeout=MOUNT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"qcowfs without -f did not return after mounting\n"
                             f"stderr:\n{m.stderr()}") from None
    assert code == 0, f"qcowfs without -f exited {code} after mounting\n{m.stderr()}"
    m.daemon_pids = find_pids(m.argv)


def finish_mount(m: Mount, foreground: bool, expect_exit: int | None) -> None:
    unmount(m.target)
    if foreground:
        wait_foreground_exit(m, expect_exit)
    else:
        wait_daemon_exit(m)
    assert not is_fuse_mounted(m.target), f"{m.target} still mounted after unmount"


def abandon_mount(m: Mount) -> None:
    """Cleans up after a mount that never came up, without asserting anything."""
    unmount(m.target)
    with contextlib.suppress(subprocess.TimeoutExpired):
        m.proc.wait(timeout=EXIT_TIMEOUT_S)
    if m.proc.poll() is None:
        kill_group(m.proc.pid)
        m.proc.wait()
    for pid in find_pids(m.argv):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def wait_foreground_exit(m: Mount, expect_exit: int | None) -> None:
    try:
        code = m.proc.wait(timeout=EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill_group(m.proc.pid)
        m.proc.wait(timeout=EXIT_TIMEOUT_S)
        raise AssertionError(f"qcowfs did not exit within {EXIT_TIMEOUT_S}s of unmount; "
                             f"killed\nstderr:\n{m.stderr()}") from None
    if expect_exit is not None:
        assert code == expect_exit, (
            f"qcowfs exited with {code}, expected {expect_exit}\nstderr:\n{m.stderr()}")


def wait_daemon_exit(m: Mount) -> None:
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    while time.monotonic() < deadline:
        if not any(pid_alive(p) for p in m.daemon_pids):
            return
        time.sleep(0.05)
    for pid in m.daemon_pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    raise AssertionError(f"qcowfs daemon {m.daemon_pids} still running "
                         f"{EXIT_TIMEOUT_S}s after unmount; killed")


def kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def mount_fails(image: str | os.PathLike, target: str | os.PathLike,
                opts: Sequence[str] = ()) -> tuple[int, str]:
    """Runs qcowfs -f on image and asserts it refuses: exits non-zero, mounts nothing.

    Returns (exit code, stderr) for the caller to check the message.
    """
    target = Path(target)
    if not target.exists():
        target.touch()
    argv = [qcowfs_bin(), "-f"]
    if opts:
        argv += ["-o", ",".join(opts)]
    argv += [str(image), str(target)]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=MOUNT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        unmount(target)
        kill_group(proc.pid)
        out, err = proc.communicate()
        raise AssertionError(f"qcowfs did not refuse {image} (still running after "
                             f"{MOUNT_TIMEOUT_S}s): {' '.join(argv)}\n"
                             f"stderr:\n{err.decode(errors='replace')}") from None
    mounted_anyway = is_fuse_mounted(target)
    if mounted_anyway:
        unmount(target)
    text = (err + out).decode(errors="replace")
    assert not mounted_anyway, f"qcowfs mounted {image} although it should refuse it"
    assert proc.returncode != 0, f"qcowfs exited 0 on {image}; output:\n{text}"
    return proc.returncode, text


def cleanup_mounts_under(directory: str | os.PathLike) -> list[str]:
    """Unmounts every FUSE mount at or below directory; returns what was found."""
    root = os.path.realpath(directory)
    found = [t for t in mountinfo_targets() if t == root or t.startswith(root + "/")]
    for t in sorted(found, key=len, reverse=True):
        unmount(t)
    return found


# --------------------------------------------------------------------------
# Block devices

@contextlib.contextmanager
def loop_device(path: Path, *extra: str) -> Iterator[str]:
    """A loop device over path (losetup options in extra), detached afterwards."""
    dev = run(["losetup", "-f", "--show", *extra, str(path)]).stdout.decode().strip()
    try:
        yield dev
    finally:
        run(["losetup", "-d", dev], check=False)


@contextlib.contextmanager
def host_fs_on_4k_device(workdir: Path) -> Iterator[Path]:
    """An ext4 file system on a loop device with 4096-byte sectors, mounted under workdir."""
    backing = workdir / "backing.img"
    with open(backing, "wb") as f:
        f.truncate(128 << 20)
    mnt = workdir / "hostfs"
    mnt.mkdir()
    with loop_device(backing, "--sector-size", "4096") as dev:
        assert run(["blockdev", "--getss", dev]).stdout.decode().strip() == "4096"
        run(["mkfs.ext4", "-q", "-F", dev])
        run(["mount", dev, str(mnt)])
        try:
            yield mnt
        finally:
            cleanup_mounts_under(mnt)
            run(["umount", str(mnt)], check=False)


# --------------------------------------------------------------------------
# Images in use by another process

# What qcowfs and QEMU say when an image's write lock is refused: `create` and
# `check -r` refused by a user that does not share "write", a reader refused by a writer.
WRITE_LOCK_REFUSED = r'failed to get "write" lock'
SHARED_WRITE_LOCK_REFUSED = r'failed to get shared "write" lock'


class QemuIoSession:
    """An interactive qemu-io (commands on its stdin); it flushes its output and
    prompt ("qemu-io> ") after each command, so the prompt marks a finished command."""
    PROMPT = b"qemu-io> "

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    def read_to_prompt(self, timeout: float = MOUNT_TIMEOUT_S) -> str:
        out = b""
        deadline = time.monotonic() + timeout
        while not out.endswith(self.PROMPT):
            left = deadline - time.monotonic()
            assert left > 0, f"qemu-io gave no prompt within {timeout}s; output: {out!r}"
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            chunk = os.read(self.proc.stdout.fileno(), 65536) if ready else b""
            assert chunk or not ready, f"qemu-io exited; output: {out.decode(errors='replace')}"
            out += chunk
        return out[:-len(self.PROMPT)].decode(errors="replace")

    def command(self, cmd: str) -> str:
        """Runs cmd and returns its output once it has finished."""
        self.proc.stdin.write(cmd.encode() + b"\n")
        self.proc.stdin.flush()
        return self.read_to_prompt()


@contextlib.contextmanager
def qemu_io_holding(image: str | os.PathLike, fmt: str = "qcow2") -> Iterator[QemuIoSession]:
    """qemu-io with image open read-write, holding QEMU's locks as a VM does, until the block ends.

    Its first prompt comes once the image is open (locked); it quits at the end of its stdin.
    """
    proc = subprocess.Popen(["qemu-io", "-f", fmt, str(image)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        session = QemuIoSession(proc)
        session.read_to_prompt()
        yield session
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            proc.wait()


@contextlib.contextmanager
def held_read_write(image: str | os.PathLike, holder: str, workdir: Path, fmt: str = "qcow2") -> Iterator[None]:
    """image held read-write by `holder`: "mount" (a qcowfs -o rw mount) or "qemu-io"."""
    if holder == "mount":
        with mounted(image, workdir / "holder.raw", ["rw", f"format={fmt}"]):
            yield
    else:
        assert holder == "qemu-io", holder
        with qemu_io_holding(image, fmt):
            yield
