"""`qcowfs map --json` against `qemu-img map --output=json`.

qcowfs map reports what BlockDriver::block_status knows: start, length,
depth, zero and data. It has no host offsets, so qemu-img's ranges are
compared after merging neighbours that differ only in their offset, and
"present" is compared where data is stored (qemu also marks zero clusters
stored in the image as present; block_status does not tell those apart from
unallocated ranges).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import helpers

MiB = 1 << 20
KEYS = ("depth", "zero", "data")


def merged(entries: list[dict]) -> list[dict]:
    out: list[dict] = []
    for e in entries:
        e = {k: e[k] for k in ("start", "length", *KEYS, "present")}
        if out and all(out[-1][k] == e[k] for k in KEYS) and out[-1]["start"] + out[-1]["length"] == e["start"]:
            out[-1]["length"] += e["length"]
        else:
            out.append(e)
    return out


def compare(qcowfs: str, img: Path) -> None:
    theirs = merged(helpers.qemu_img_map(img))
    ours = json.loads(helpers.run([qcowfs, "map", "--json", img]).stdout)
    assert [{k: e[k] for k in ("start", "length", *KEYS)} for e in ours] == \
        [{k: e[k] for k in ("start", "length", *KEYS)} for e in theirs]
    for o, t in zip(ours, theirs):
        if t["data"]:
            assert o["present"] is True


def image(workdir: Path, name: str, *opts: str, size: str = "32M", backing: Path | None = None) -> Path:
    p = workdir / name
    args = ["create", "-q", "-f", "qcow2"]
    if opts:
        args += ["-o", ",".join(opts)]
    if backing:
        args += ["-b", str(backing), "-F", helpers.probe_format(backing)]
    helpers.qemu_img(*args, p, size)
    return p


@pytest.mark.parametrize("opts", [(), ("cluster_size=4K",), ("extended_l2=on",), ("compat=0.10",)])
def test_map_single_image(workdir: Path, qcowfs: str, opts: tuple[str, ...]) -> None:
    img = image(workdir, "a.qcow2", *opts)
    helpers.qemu_io(img, "write -P 1 0 100k", "write -P 2 3M 1M", "write -c -P 3 8M 64k", "write -P 4 31M 1M")
    compare(qcowfs, img)


def test_map_backing_chain(workdir: Path, qcowfs: str) -> None:
    base = workdir / "base.raw"
    base.write_bytes(b"")
    with open(base, "r+b") as f:
        f.truncate(32 * MiB)
        f.seek(2 * MiB)
        f.write(b"\x09" * MiB)
    mid = image(workdir, "mid.qcow2", backing=base)
    helpers.qemu_io(mid, "write -P 5 8M 2M")
    top = image(workdir, "top.qcow2", backing=mid)
    helpers.qemu_io(top, "write -P 6 2560k 64k", "write -P 7 9M 64k")
    compare(qcowfs, top)


def test_map_raw(workdir: Path, qcowfs: str) -> None:
    raw = workdir / "disk.raw"
    with open(raw, "wb") as f:
        f.truncate(16 * MiB)
        f.seek(4 * MiB)
        f.write(b"\x01" * MiB)
    ours = json.loads(helpers.run([qcowfs, "map", "--json", raw]).stdout)
    data = [(e["start"], e["length"]) for e in ours if e["data"]]
    assert data == [(4 * MiB, MiB)]
    assert sum(e["length"] for e in ours) == 16 * MiB


def test_map_human_lists_data_ranges(workdir: Path, qcowfs: str) -> None:
    img = image(workdir, "a.qcow2")
    helpers.qemu_io(img, "write -P 1 1M 1M")
    out = helpers.run([qcowfs, "map", img]).stdout.decode().splitlines()
    assert out[0].split() == ["Offset", "Length", "Depth"]
    assert out[1].split() == ["0x100000", "0x100000", "0"]
    assert len(out) == 2
