"""The Debian package: packaging/build-deb.sh builds it from debian/ with
dpkg-buildpackage (-O2 from dpkg-buildflags, tests off) and lintian passes it with no errors;
`apt-get install ./qcowfs_*.deb` installs it into this system, the installed
/usr/bin/qcowfs mounts an image (also as `mount -t fuse.qcowfs` and from an
fstab line) and runs the image commands; the package is purged afterwards,
pass or fail.

The package is built by tests/support/build-test-deb.sh in $QCOWFS_BUILD_DIR/deb
when set (ctest sets it), and build-deb.sh keeps its CMake object directory
there, so reruns recompile only what changed (tests/run-all.sh compiles it
there in the background, at idle priority, before this file runs); else in a
pytest temporary directory (a full build).
Both tests share one build and one installation; the package is purged after them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from qcowfs_testlib import helpers

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20
BUILD_TIMEOUT_S = 1200


def installed() -> bool:
    proc = subprocess.run(["dpkg-query", "-W", "-f=${Status}", "qcowfs"], capture_output=True, text=True)
    return proc.returncode == 0 and "installed" in proc.stdout.split()


def serving_pids(exe: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/exe") == exe:
                    pids.append(int(entry))
            except OSError:
                continue
    return pids


def purge() -> None:
    subprocess.run(["apt-get", "purge", "-y", "-q", "qcowfs"], capture_output=True, timeout=300)


@pytest.fixture(scope="module")
def built_deb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Builds and lints the package once for this file's tests
    (tests/support/build-test-deb.sh: build-deb.sh without -g and -dbgsym)."""
    assert not installed(), "qcowfs is already installed on this system: refusing to replace it"
    build_root = os.environ.get("QCOWFS_BUILD_DIR")
    out = Path(build_root) / "deb" if build_root else tmp_path_factory.mktemp("deb")
    proc = helpers.run([REPO / "tests" / "support" / "build-test-deb.sh", out], timeout=BUILD_TIMEOUT_S)
    deb = Path(proc.stdout.decode().strip().splitlines()[-1])
    assert deb.is_file() and deb.name.startswith("qcowfs_") and deb.suffix == ".deb"
    # build-deb.sh fails on lintian errors itself; check the package independently of it.
    changes = deb.with_suffix(".changes")
    lint = subprocess.run(["lintian", "--fail-on", "none", "--tag-display-limit", "0", changes],
                          capture_output=True, text=True, timeout=600)
    assert lint.returncode == 0, f"lintian did not run: {lint.stdout}{lint.stderr}"
    errors = [l for l in lint.stdout.splitlines() if l.startswith("E: ")]
    assert not errors, "lintian errors:\n" + "\n".join(errors)
    return deb


@pytest.fixture(scope="module")
def package(built_deb: Path) -> Path:
    """The package installed for this file's tests, purged after the last of them."""
    assert not installed(), "qcowfs is already installed on this system: refusing to replace it"
    deb = built_deb
    try:
        proc = subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", f"./{deb.name}"],
                              cwd=deb.parent, capture_output=True, timeout=300)
        assert proc.returncode == 0, f"apt-get install failed: {proc.stdout.decode()}{proc.stderr.decode()}"
        assert installed()
        yield deb
    finally:
        purge()
    assert not installed()
    assert not Path("/usr/bin/qcowfs").exists(), "purging the package removes the binary"


def test_package_metadata(package: Path) -> None:
    fields = helpers.run(["dpkg-deb", "-f", package, "Package", "Version", "Depends"]).stdout.decode()
    version = re.search(r"^project\(qcowfs VERSION ([0-9.]+)", (REPO / "CMakeLists.txt").read_text(), re.M)
    assert f"Version: {version.group(1)}\n" in fields
    # libcurl4 and libnbd0 are dlopened (io/remote/lazy_library.h): named in debian/control.
    for dep in ("libfuse3-3", "liburing2", "zlib1g", "libzstd1", "libfmt9", "fuse3", "libcurl4", "libnbd0"):
        assert dep in fields, dep
    files = helpers.run(["dpkg", "-L", "qcowfs"]).stdout.decode().split()
    for path in ("/usr/bin/qcowfs", "/usr/share/man/man1/qcowfs.1.gz",
                 "/usr/share/bash-completion/completions/qcowfs", "/usr/share/doc/qcowfs/copyright"):
        assert path in files and Path(path).exists(), path
    assert b"qcowfs create" in helpers.run(["man", "-P", "cat", "qcowfs"]).stdout
    out = helpers.run(["bash", "-c", "source /usr/share/bash-completion/completions/qcowfs; "
                       "COMP_WORDS=(qcowfs che); COMP_CWORD=1; _qcowfs; echo ${COMPREPLY[@]}"]).stdout
    assert out.split() == [b"check"]


def test_installed_binary_mounts_and_runs_commands(package: Path, workdir: Path) -> None:
    qcowfs = "/usr/bin/qcowfs"
    assert helpers.run([qcowfs, "--version"]).stdout.startswith(b"qcowfs ")
    img = workdir / "disk.qcow2"
    helpers.run([qcowfs, "create", "-q", "-o", "cluster_size=4K", img, "16M"])
    helpers.qemu_img_check(img)
    helpers.qemu_io(img, "write -P 0x71 2M 64k")
    assert json.loads(helpers.run([qcowfs, "info", "--json", img]).stdout)["cluster-size"] == 4096
    assert helpers.run([qcowfs, "check", img]).returncode == 0

    mnt = workdir / "mnt"
    mnt.mkdir()
    helpers.run(["mount", "-t", "fuse.qcowfs", img, mnt, "-o", "ro,nosuid,nodev"])
    try:
        line = next(l for l in Path("/proc/mounts").read_text().splitlines() if f" {mnt} " in l)
        assert " fuse.qcowfs " in line
        with open(mnt / "disk.raw", "rb") as f:
            f.seek(2 * MiB)
            assert f.read(65536) == b"\x71" * 65536
        assert serving_pids("/usr/bin/qcowfs"), "the installed binary serves the mount"
    finally:
        helpers.run(["umount", mnt])

    # Mount failures through mount(8) exit non-zero with the reason on stderr
    # (the daemon reports only once the mount is up or has failed).
    corrupt = workdir / "corrupt.qcow2"
    corrupt.write_bytes(img.read_bytes()[:4] + (99).to_bytes(4, "big") + img.read_bytes()[8:65536])
    for image, opts, reason in ((img, "ro,cache=sometimes", b"cache"), (corrupt, "ro", b"corrupt.qcow2")):
        bad = helpers.run(["mount", "-t", "fuse.qcowfs", image, mnt, "-o", opts], check=False)
        assert bad.returncode != 0 and reason in bad.stderr, (opts, bad.stderr)
        assert not helpers.is_fuse_mounted(mnt)

    fstab = workdir / "fstab"
    fstab.write_text(f"{img}  {mnt}  fuse.qcowfs  ro,noauto,nofail,_netdev  0  0\n")
    helpers.run(["mount", "-T", fstab, mnt])
    try:
        assert (mnt / "disk.raw").stat().st_size == 16 * MiB
    finally:
        helpers.run(["umount", mnt])
    deadline = time.monotonic() + 10
    while helpers.is_fuse_mounted(mnt) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not helpers.is_fuse_mounted(mnt)
