"""`qcowfs map` against `qemu-img map` (QEMU 7.2), literally.

For every image kind both tools run with the same arguments from the same
directory, and their outputs must be equal: the JSON lists after json.loads
and as text, and the human tables as text (header, hex columns, the file
holding each range). Where qemu-img fails (the human form refuses compressed
clusters) qcowfs must fail the same way: same exit code, same stdout, the
same message after the program name.

The one kind that legitimately differs is a raw file whose size is not a
multiple of 512: QEMU rounds a raw image up to whole sectors, while qcowfs
shows the file as it is; the map then differs only in the last range's length.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Callable

import pytest

from qcowfs_testlib import helpers

MiB = 1 << 20


def run_in(cwd: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          timeout=helpers.TOOL_TIMEOUT_S)


def message(stderr: bytes, program: str) -> str:
    text = stderr.decode().strip()
    assert text.startswith(program), text
    return text[len(program):]


def compare(qcowfs: str, cwd: Path, image: str, *fmt: str) -> list[dict]:
    """Asserts both map forms are identical; returns qemu-img's JSON list."""
    q = run_in(cwd, "qemu-img", "map", "--output=json", *fmt, image)
    o = run_in(cwd, qcowfs, "map", "--json", *fmt, image)
    assert q.returncode == 0, q.stderr.decode()
    assert o.returncode == 0, o.stderr.decode()
    theirs, ours = json.loads(q.stdout), json.loads(o.stdout)
    assert ours == theirs
    assert o.stdout.decode() == q.stdout.decode()
    q = run_in(cwd, "qemu-img", "map", *fmt, image)
    o = run_in(cwd, qcowfs, "map", *fmt, image)
    assert o.stdout.decode() == q.stdout.decode()
    assert o.returncode == q.returncode
    if q.returncode != 0:
        assert message(o.stderr, "qcowfs map: ") == message(q.stderr, "qemu-img: ")
    return theirs


def qcow2(path: Path, size: str, *opts: str, backing: Path | None = None) -> Path:
    args = ["create", "-q", "-f", "qcow2"]
    if opts:
        args += ["-o", ",".join(opts)]
    if backing:
        args += ["-b", backing.name, "-F", helpers.probe_format(backing)]
    helpers.qemu_img(*args, path, size)
    return path


def sparse_raw(path: Path, size: int, *extents: tuple[int, int]) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)
        for off, length in extents:
            f.seek(off)
            f.write(bytes([0x5a]) * length)
    return path


# Each builder makes an image in a directory and returns its name there.


def raw_sparse(d: Path) -> str:
    sparse_raw(d / "disk.raw", 16 * MiB, (4 * MiB, MiB), (9 * MiB + 4096, 8192))
    return "disk.raw"


def qcow2_empty(d: Path) -> str:
    qcow2(d / "e.qcow2", "16M")
    return "e.qcow2"


def qcow2_empty_disk(d: Path) -> str:
    qcow2(d / "zero-size.qcow2", "0")
    return "zero-size.qcow2"


def partial_writes(cluster_size: str) -> Callable[[Path], str]:
    def build(d: Path) -> str:
        img = qcow2(d / f"c{cluster_size}.qcow2", "64M", f"cluster_size={cluster_size}")
        helpers.qemu_io(img, "write -P 1 0 100k", "write -P 2 3M 1M", "write -P 3 7000k 512",
                        "write -P 4 31M 1M", "write -P 5 33M 4k", "write -P 6 63M 1M")
        return img.name
    build.__name__ = f"partial_writes_{cluster_size}"
    return build


def zero_clusters(d: Path) -> str:
    img = qcow2(d / "z.qcow2", "8M")
    helpers.qemu_io(img, "write -P 1 0 1M", "write -z 64k 64k", "write -z -u 192k 128k", "write -z 2M 512k",
                    "write -P 2 4M 64k", "write -z 4M 64k")
    return img.name


def compressed(d: Path) -> str:
    src = qcow2(d / "src.qcow2", "16M")
    helpers.qemu_io(src, "write -P 1 0 2M", "write -P 2 5M 300k", "write -z 8M 1M")
    helpers.qemu_img("convert", "-c", "-O", "qcow2", src, d / "comp.qcow2")
    # Uncompressed writes on top: data with offsets before and after the compressed ranges.
    helpers.qemu_io(d / "comp.qcow2", "write -P 3 1M 64k", "write -P 4 12M 64k")
    return "comp.qcow2"


def chain_depth_2(d: Path) -> str:
    base = sparse_raw(d / "base.raw", 16 * MiB, (2 * MiB, MiB), (12 * MiB, 4096))
    top = qcow2(d / "top.qcow2", "20M", backing=base)
    helpers.qemu_io(top, "write -P 6 2560k 64k", "write -z 12M 64k", "write -c 5M 64k", "write -P 7 17M 64k")
    return top.name


def chain_depth_3(d: Path) -> str:
    base = sparse_raw(d / "base.raw", 12 * MiB, (2 * MiB, MiB), (8 * MiB, 2 * MiB))
    mid = qcow2(d / "mid.qcow2", "16M", backing=base)
    helpers.qemu_io(mid, "write -P 5 8M 2M", "write -z 12M 64k", "write -P 6 14M 64k")
    top = qcow2(d / "top.qcow2", "20M", backing=mid)
    helpers.qemu_io(top, "write -P 6 2560k 64k", "write -P 7 9M 64k", "write -z 14M 32k")
    return top.name


def chain_qcow2_base(d: Path) -> str:
    base = qcow2(d / "b0.qcow2", "8M")
    helpers.qemu_io(base, "write -P 1 1M 1M", "write -z 3M 1M")
    mid = qcow2(d / "b1.qcow2", "12M", backing=base)
    top = qcow2(d / "b2.qcow2", "16M", backing=mid)
    helpers.qemu_io(top, "write -P 1 1536k 64k", "write -z 10M 1M")
    return top.name


def extended_l2(d: Path) -> str:
    img = qcow2(d / "xl.qcow2", "8M", "extended_l2=on", "cluster_size=128k")
    helpers.qemu_io(img, "write -P 1 4k 4k", "write -P 1 20k 40k", "write -z 200k 8k", "write -P 2 1M 128k",
                    "write -z -u 1M 4k")
    return img.name


def extended_l2_backing(d: Path) -> str:
    base = sparse_raw(d / "base.raw", 6 * MiB, (0, 64 * 1024), (4 * MiB, 8192))
    img = qcow2(d / "xlb.qcow2", "8M", "extended_l2=on", "cluster_size=64k", backing=base)
    helpers.qemu_io(img, "write -P 1 4M 4k", "write -P 1 20k 8k", "write -z 200k 8k", "write -P 3 6M 6k")
    return img.name


def data_file(raw: bool) -> Callable[[Path], str]:
    def build(d: Path) -> str:
        name = f"ext-{'raw' if raw else 'plain'}.qcow2"
        # A relative name: QEMU resolves it against its working directory (run
        # in the image's directory here), qcowfs against the image's directory.
        for args in (["qemu-img", "create", "-q", "-f", "qcow2", "-o",
                      f"data_file={name}.data,data_file_raw={'on' if raw else 'off'}", name, "4M"],
                     ["qemu-io", "-f", "qcow2", "-c", "write -P 1 64k 4k", "-c", "write -P 2 0 4k",
                      "-c", "write -z 1M 64k", "-c", "write -P 3 3M 8k", name]):
            proc = run_in(d, *args)
            assert proc.returncode == 0 and b"error" not in proc.stdout.lower(), proc.stderr.decode()
        return name
    build.__name__ = f"data_file_{'raw' if raw else 'plain'}"
    return build


def preallocated(d: Path) -> str:
    img = qcow2(d / "p.qcow2", "8M", "preallocation=metadata")
    helpers.qemu_io(img, "write -P 1 64k 4k", "write -P 2 2M 1M", "write -z 5M 64k")
    return img.name


def compat_v2(d: Path) -> str:
    img = qcow2(d / "v2.qcow2", "8M", "compat=0.10", "cluster_size=4k")
    helpers.qemu_io(img, "write -P 1 0 12k", "write -z 64k 8k", "write -P 2 1M 4k")
    return img.name


BUILDERS = [raw_sparse, qcow2_empty, qcow2_empty_disk, partial_writes("512"), partial_writes("64k"),
            partial_writes("2M"), zero_clusters, compressed, chain_depth_2, chain_depth_3, chain_qcow2_base,
            extended_l2, extended_l2_backing, data_file(True), data_file(False), preallocated, compat_v2]


@pytest.mark.parametrize("build", BUILDERS, ids=lambda b: b.__name__)
def test_map_matches_qemu_img(workdir: Path, qcowfs: str, build: Callable[[Path], str]) -> None:
    name = build(workdir)
    entries = compare(qcowfs, workdir, name)
    assert sum(e["length"] for e in entries) == helpers.qemu_img_info(workdir / name)["virtual-size"] or \
        entries == [{"start": 0, "length": 0, "depth": 0, "present": False, "zero": False, "data": False}]


def test_map_kinds_are_really_covered(workdir: Path, qcowfs: str) -> None:
    """The matrix exercises every column: offsets, depths, present/zero/data mixes."""
    seen: set[tuple] = set()
    for build in BUILDERS:
        d = workdir / build.__name__
        d.mkdir()
        for e in compare(qcowfs, d, build(d)):
            seen.add((e["depth"], e["present"], e["zero"], e["data"], "offset" in e))
    for kind in [(0, True, False, True, True),    # data in the image
                 (0, True, False, True, False),   # compressed
                 (0, True, True, False, False),   # zero cluster
                 (0, True, True, False, True),    # zero cluster that keeps its host cluster
                 (0, True, True, True, True),     # preallocated cluster in a host hole
                 (0, False, True, False, False),  # unallocated, nothing below
                 (0, False, True, False, True),   # unallocated subcluster of an allocated cluster
                 (1, True, False, True, True),    # data in the backing file
                 (2, True, True, False, True)]:   # a hole in a raw base
        assert kind in seen, kind


def test_map_paths_as_given(workdir: Path, qcowfs: str) -> None:
    """The File column names backing files as QEMU combines them with the path given."""
    (workdir / "sub").mkdir()
    chain_depth_3(workdir / "sub")
    compare(qcowfs, workdir, "sub/top.qcow2")
    compare(qcowfs, workdir, "./sub/top.qcow2")
    compare(qcowfs, workdir / "sub", "top.qcow2")
    compare(qcowfs, workdir / "sub", "../sub/mid.qcow2")
    compare(qcowfs, Path("/"), str(workdir / "sub" / "top.qcow2"))


def test_map_explicit_format(workdir: Path, qcowfs: str) -> None:
    img = qcow2(workdir / "q.qcow2", "4M")
    helpers.qemu_io(img, "write -P 1 1M 64k")
    compare(qcowfs, workdir, "q.qcow2", "-f", "qcow2")
    compare(qcowfs, workdir, "q.qcow2", "-f", "raw")  # the qcow2 file seen as a raw disk


def test_map_raw_unaligned_size(workdir: Path, qcowfs: str) -> None:
    """QEMU rounds a raw image up to 512-byte sectors; qcowfs maps the file's own size."""
    img = workdir / "odd.raw"
    sparse_raw(img, 5000, (0, 4096))  # data, then a hole up to the end of the file
    theirs = json.loads(run_in(workdir, "qemu-img", "map", "--output=json", "-f", "raw", img.name).stdout)
    ours = json.loads(run_in(workdir, qcowfs, "map", "--json", "-f", "raw", img.name).stdout)
    assert sum(e["length"] for e in theirs) == 5120
    assert sum(e["length"] for e in ours) == 5000
    assert ours[:-1] == theirs[:-1]
    assert ours[-1] == dict(theirs[-1], length=theirs[-1]["length"] - 120)


def test_map_relative_data_file_from_elsewhere(workdir: Path, qcowfs: str) -> None:
    """A relative external data file name is found next to the image from any directory.

    (qemu-img 7.2 looks for it in its working directory instead, so it can only
    map such an image from the image's own directory.)
    """
    (workdir / "sub").mkdir()
    name = data_file(False)(workdir / "sub")
    here = json.loads(run_in(workdir / "sub", qcowfs, "map", "--json", name).stdout)
    there = run_in(workdir, qcowfs, "map", "--json", f"sub/{name}")
    assert there.returncode == 0, there.stderr.decode()
    assert json.loads(there.stdout) == here
    human = run_in(workdir, qcowfs, "map", f"sub/{name}").stdout.decode().splitlines()
    assert len(human) > 1 and all(line.endswith(f"sub/{name}.data") for line in human[1:])


def test_map_errors(workdir: Path, qcowfs: str) -> None:
    assert helpers.run([qcowfs, "map", workdir / "missing.qcow2"], check=False).returncode == 1
    assert helpers.run([qcowfs, "map"], check=False).returncode == 1
    assert helpers.run([qcowfs, "map", "--help"]).stdout.startswith(b"usage: qcowfs map")
