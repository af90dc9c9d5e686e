"""Helpers for the `qcowfs create -f FORMAT` tests, with qemu-img 7.2 as the referee.

  create_in_both(dirs, fmt, args, name, size)
      runs `create -f FMT ARGS NAME [SIZE]` by qemu-img in dirs[0] and by qcowfs
      in dirs[1] (their working directories); the two results.
  create_side_by_side(workdir, fmt, args, name, size)
      runs `qemu-img create -f FMT ARGS NAME [SIZE]` in workdir/qemu and `qcowfs
      create -f FMT ARGS NAME [SIZE]` in workdir/ours (the same relative name, so that file
      names written into the images compare), asserts both succeed with the same
      "Formatting" line and make the same set of files; returns both images.
  assert_same_info(theirs, ours, fmt, ignore)
      `qemu-img info --output=json` of both equal, but for file names, sizes on
      disk and the format-specific keys in `ignore` (random fields).
  refused_like_qemu_img(workdir, fmt, args, name, size)
      both tools refuse `create -f FMT ARGS NAME [SIZE]`: exit 1, and qcowfs leaves no
      file behind; returns the two messages without program and image names.
  write_through_rw_mount(image, fmt, workdir, writes)
      mounts the image read-write, writes (offset, bytes) pairs through the view,
      unmounts, and has `qemu-img compare` check the image against the expected
      raw disk (zeros plus the writes).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Sequence

from qcowfs_testlib import helpers


def create_in_both(dirs: tuple[Path, Path], fmt: str, args: Sequence[str], name: str,
                   size: str | None) -> list[tuple[subprocess.CompletedProcess, set[str]]]:
    """`create -f FMT ARGS NAME [SIZE]` by qemu-img in dirs[0], by qcowfs in dirs[1];
    each result with the names in its directory before it ran."""
    tools = (["qemu-img", "create", "-f", fmt], [helpers.qcowfs_bin(), "create", "-f", fmt])
    results = []
    for d, tool in zip(dirs, tools):
        d.mkdir(exist_ok=True)
        before = set(os.listdir(d))
        argv = [str(a) for a in (*tool, *args, name, *([size] if size else []))]
        results.append((subprocess.run(argv, cwd=d, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       timeout=helpers.TOOL_TIMEOUT_S), before))
    return results


def create_side_by_side(workdir: Path, fmt: str, args: Sequence[str], name: str,
                        size: str | None = None) -> tuple[Path, Path]:
    dirs = (workdir / "qemu", workdir / "ours")
    (q, _), (o, _) = create_in_both(dirs, fmt, args, name, size)
    assert q.returncode == 0 and o.returncode == 0, (q.stderr.decode(), o.stderr.decode())
    assert o.stdout.decode() == q.stdout.decode()
    assert q.stdout.decode().startswith(f"Formatting '{name}', fmt={fmt} ")
    assert sorted(p.name for p in dirs[0].iterdir()) == sorted(p.name for p in dirs[1].iterdir())
    return dirs[0] / name, dirs[1] / name


def info_for_comparison(image: Path, fmt: str, ignore: Sequence[str]) -> dict:
    info = helpers.qemu_img_info(image, fmt=fmt)
    for key in ("filename", "actual-size"):
        info.pop(key, None)
    if "full-backing-filename" in info:
        info["full-backing-filename"] = Path(info["full-backing-filename"]).name
    data = info.get("format-specific", {}).get("data", {})
    for key in ignore:
        data.pop(key, None)
    for extent in data.get("extents", []):
        extent["filename"] = Path(extent["filename"]).name
    return info


def assert_same_info(theirs: Path, ours: Path, fmt: str, ignore: Sequence[str] = ()) -> dict:
    expected = info_for_comparison(theirs, fmt, ignore)
    assert info_for_comparison(ours, fmt, ignore) == expected
    return expected


def refused_like_qemu_img(workdir: Path, fmt: str, args: Sequence[str], name: str,
                          size: str | None = None) -> tuple[str, str]:
    dirs = (workdir / "qemu-refused", workdir / "ours-refused")
    results = create_in_both(dirs, fmt, args, name, size)
    messages = []
    for p, _ in results:
        assert p.returncode == 1, (p.args[0], args, p.stderr.decode())
        text = p.stderr.decode().strip()
        messages.append(text.removeprefix("qemu-img: ").removeprefix("qcowfs create: ").replace(f"{name}: ", ""))
    _, before = results[1]
    assert set(os.listdir(dirs[1])) == before, f"qcowfs left files behind for {args}"
    return messages[0], messages[1]


def write_through_rw_mount(image: Path, fmt: str, workdir: Path, writes: Sequence[tuple[int, bytes]]) -> None:
    size = helpers.qemu_img_info(image, fmt=fmt)["virtual-size"]
    expected = workdir / f"{image.name}.expected.raw"
    with open(expected, "wb") as f:
        f.truncate(size)
        for off, data in writes:
            f.seek(off)
            f.write(data)
    with helpers.mounted(image, workdir / f"{image.name}.view", [f"format={fmt}", "rw"]) as m:
        assert os.path.getsize(m.path) == size
        fd = os.open(m.path, os.O_WRONLY)
        try:
            for off, data in writes:
                assert os.pwrite(fd, data, off) == len(data)
            os.fsync(fd)
        finally:
            os.close(fd)
    helpers.run(["qemu-img", "compare", "-f", "raw", "-F", fmt, expected, image])
    expected.unlink()

