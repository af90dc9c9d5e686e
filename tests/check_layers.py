#!/usr/bin/env python3
"""Layering check: dependencies between the source layers point down only.

    io < image < tools, fuse

A file may include headers of its own layer and of the layers below it.
tools/ never includes fuse/ (the subcommands use no FUSE); fuse/ includes
tools/ only in main.cc, which dispatches to the subcommands. FUSE headers
(libfuse's <fuse_lowlevel.h>, <fuse3/...>, ..., and <linux/fuse.h>) are included only under fuse/.

Usage: check_layers.py [SOURCE_DIR]   (default: the parent of this script's
directory). Prints one line per violation, FILE:LINE: what, and exits 1 if
there is any.
"""
import pathlib
import re
import sys

RANK = {"io": 0, "image": 1, "tools": 2, "fuse": 2}
# Includes of a peer layer that are allowed: (including file, included layer).
ALLOWED = {("fuse/main.cc", "tools")}
PEER_RULE = {
    ("tools", "fuse"): "tools/ never includes fuse/",
    ("fuse", "tools"): "fuse/ includes tools/ only in main.cc, to dispatch",
}
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')
FUSE_HEADER = re.compile(r"^(fuse3/.*|linux/fuse\.h|c?fuse(_[a-z_]+)?\.h|cuse_lowlevel\.h)$")


def layer_violation(rel, layer, target):
    if target not in RANK or target == layer or (rel, target) in ALLOWED:
        return None
    if RANK[target] > RANK[layer]:
        return f"{layer}/ includes the higher layer {target}/"
    if RANK[target] == RANK[layer]:
        return PEER_RULE[(layer, target)]
    return None


def check_file(root, path):
    rel = path.relative_to(root).as_posix()
    layer = rel.split("/", 1)[0]
    problems = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            m = INCLUDE.match(line)
            if not m:
                continue
            header = m.group(2)
            if layer != "fuse" and FUSE_HEADER.match(header):
                problems.append(f"{rel}:{lineno}: FUSE header <{header}> outside fuse/")
                continue
            if m.group(1) != '"' or "/" not in header:
                continue
            why = layer_violation(rel, layer, header.split("/", 1)[0])
            if why:
                problems.append(f'{rel}:{lineno}: #include "{header}": {why}')
    return problems


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parent.parent)
    problems = []
    scanned = 0
    for layer in RANK:
        for path in sorted((root / layer).rglob("*")):
            if path.suffix in (".h", ".cc") and path.is_file():
                scanned += 1
                problems += check_file(root, path)
    for p in problems:
        print(p)
    if scanned == 0:
        print(f"no sources found under {root}")
        return 1
    if problems:
        print(f"layering: {len(problems)} violation(s) in {scanned} files")
        return 1
    print(f"layering: {scanned} files, no violations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
