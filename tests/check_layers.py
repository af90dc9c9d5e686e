#!/usr/bin/env python3
"""Layering check: dependencies between the source layers point down only.

    io < image < tools, fuse

A file may include headers of its own layer and of the layers below it.
tools/ never includes fuse/ (the subcommands use no FUSE); fuse/ includes
tools/ only in main.cc, which dispatches to the subcommands. FUSE headers
(libfuse's <fuse_lowlevel.h>, <fuse3/...>, ..., and <linux/fuse.h>) are included only under fuse/.

Inside image/, the root is the contract (BlockDriver, the registry, probing,
opening, create and check); image/extent/ (the engine of the table-mapped
formats), image/crypto/ (encryption) and image/views/ (windows, partitions)
are shared: any file may include their headers. Every other subfolder is one
format (image/raw/, image/qcow2/, ...). Its public headers are the ones whose
name starts with the folder's name (image/qcow2/qcow2.h,
image/qcow2/qcow2_check.h); every other header in it is private to the
folder. No format includes another format's headers, public or not. Outside
image/, only a format's public headers may be included, and in image/'s root
only by the format registry (image/formats.cc): the rest of the root knows
formats only through the registry. tools/ includes no format at all: the
subcommands reach every format through the registry (image/format.h), so a new
format is its folder and a registry row. The shared folders include no format.
tests/ may include anything (unit tests reach into private headers).

No C++ unit test runs Python: a string literal in a .cc or .h file under
tests/unit/ that names python (a popen/system/exec command such as
"python3 -c ..." or PYTHONPATH=...) is reported. Test data a Python generator
makes comes from a ctest fixture instead (tests/CMakeLists.txt: the hostile
corpus), and image edits from C++ helpers (tests/unit/vhdx/vhdx_test_edit.h).

Usage: check_layers.py [SOURCE_DIR]   (default: the parent of this script's
directory). Prints one line per violation, FILE:LINE: what, and exits 1 if
there is any.
       check_layers.py --self-test   checks a made-up tree: every kind of wrong
include, and a unit test that runs Python, must be reported and every allowed
one must not.
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


REGISTRY = "image/formats.cc"
SHARED = {"extent", "crypto", "views"}


def image_folder(rel):
    """The subfolder of image/ a path is in (image/qcow2/x.h -> qcow2), else None."""
    parts = rel.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "image" else None


def format_folder(rel):
    """The format a path under image/ belongs to, else None (the root and shared folders)."""
    folder = image_folder(rel)
    return None if folder in SHARED else folder


def format_violation(rel, header):
    fmt = format_folder(header)
    if fmt is None or image_folder(rel) == fmt:
        return None
    if format_folder(rel) is not None:
        return f"the {format_folder(rel)} format includes the {fmt} format (formats share only extent/, crypto/ and views/)"
    if image_folder(rel) in SHARED:
        return f"the shared folder image/{image_folder(rel)}/ includes the {fmt} format"
    if rel.startswith("tools/"):
        return f"tools/ includes the {fmt} format; the subcommands reach formats only through the registry (image/format.h)"
    if not pathlib.PurePosixPath(header).name.startswith(fmt):
        return f"a private header of the {fmt} format (only {fmt}*.h are public)"
    if rel.startswith("image/") and rel != REGISTRY:
        return f"image/'s root includes the {fmt} format; only the registry ({REGISTRY}) may"
    return None


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
            why = layer_violation(rel, layer, header.split("/", 1)[0]) or format_violation(rel, header)
            if why:
                problems.append(f'{rel}:{lineno}: #include "{header}": {why}')
    return problems


# A C++ string literal (no raw strings: none of the unit tests uses them).
STRING_LITERAL = re.compile(r'"(?:[^"\\\n]|\\.)*"')
PYTHON = re.compile(r"python", re.IGNORECASE)


def check_unit_test(root, path):
    """A unit test source whose string literals name python (a command it runs)."""
    rel = path.relative_to(root).as_posix()
    problems = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            code = line.split("//", 1)[0] if line.lstrip().startswith("//") else line
            for literal in STRING_LITERAL.findall(code):
                if PYTHON.search(literal):
                    problems.append(f"{rel}:{lineno}: a unit test runs Python ({literal[:60]}); no C++ test may: "
                                    "use a C++ helper, or a ctest fixture for generated data")
                    break
    return problems


def check_tree(root):
    problems = []
    scanned = 0
    for layer in RANK:
        for path in sorted((root / layer).rglob("*")):
            if path.suffix in (".h", ".cc") and path.is_file():
                scanned += 1
                problems += check_file(root, path)
    for path in sorted((root / "tests" / "unit").rglob("*")):
        if path.suffix in (".h", ".cc") and path.is_file():
            scanned += 1
            problems += check_unit_test(root, path)
    return problems, scanned


# (file, included header, reported?) for --self-test.
SELF_TEST = [
    ("io/a.cc", "image/block_driver.h", True),
    ("image/a.cc", "tools/cmd.h", True),
    ("image/a.cc", "fuse/server.h", True),
    ("tools/a.cc", "fuse/server.h", True),
    ("fuse/a.cc", "tools/cmd.h", True),
    ("fuse/main.cc", "tools/cmd.h", False),
    ("tools/a.cc", "<fuse_lowlevel.h>", True),
    ("image/a.cc", "<linux/fuse.h>", True),
    ("fuse/a.cc", "<fuse_lowlevel.h>", False),
    ("tools/a.cc", "image/qcow2/header.h", True),
    ("tools/a.cc", "image/qcow2/qcow2_check.h", True),
    ("tools/a.cc", "image/luks/luks.h", True),
    ("tools/a.cc", "image/format.h", False),
    ("tools/a.cc", "image/crypto/secret.h", False),
    ("fuse/a.cc", "image/raw/raw.h", False),
    ("image/vmdk/a.cc", "image/qcow2/writer.h", True),
    ("image/vmdk/a.cc", "image/qcow2/qcow2.h", True),
    ("image/qcow2/a.h", "image/luks/luks.h", True),
    ("image/vmdk/a.cc", "image/extent/driver.h", False),
    ("image/qcow2/a.cc", "image/crypto/cipher.h", False),
    ("image/extent/a.cc", "image/qcow2/qcow2.h", True),
    ("fuse/a.cc", "image/views/window.h", False),
    ("tools/a.cc", "image/extent/table_cache.h", False),
    ("image/qcow2/a.cc", "image/qcow2/writer.h", False),
    ("image/open.cc", "image/qcow2/qcow2.h", True),
    ("image/formats.cc", "image/qcow2/qcow2.h", False),
    ("image/formats.cc", "image/qcow2/format.h", True),
    ("image/a.cc", "io/host_file.h", False),
    ("tools/a.cc", "image/block_driver.h", False),
]


# (file, its one line, reported?) for --self-test: unit tests running Python.
SELF_TEST_PYTHON = [
    ("tests/unit/vhdx/a_test.cc", 'sh("python3 -c \\"$ED; e.set_bat(0, 6)\\"");', True),
    ("tests/unit/image/a_test.cc", 'std::system("PYTHONPATH=x python3 -m gen out");', True),
    ("tests/unit/image/a_test.cc", 'FILE* p = ::popen("cd d && Python -c 1", "r");', True),
    ("tests/unit/image/util.h", 'execlp("python3", "python3", "-c", "pass", nullptr);', True),
    ("tests/unit/vhdx/a_test.cc", 'sh("qemu-img create -q -f vhdx i.vhdx 16M");', False),
    ("tests/unit/vhdx/a_test.cc", "// the Python side's re.search, sh(\"python3 ...\") in comments", False),
    ("tests/unit/image/a_test.cc", 'int python_like = 1;  // an identifier, no command', False),
    ("tests/integration/helpers.cc", 'std::system("python3 -c 1");', False),
]


def self_test():
    import tempfile
    failures = 0
    cases = [(rel, f"#include {h if h.startswith('<') else chr(34) + h + chr(34)}", bad)
             for rel, h, bad in SELF_TEST] + SELF_TEST_PYTHON
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        for i, (rel, text, bad) in enumerate(cases):
            case = root / str(i)
            (case / rel).parent.mkdir(parents=True)
            (case / rel).write_text(text + "\n")
            problems, _ = check_tree(case)
            if bool(problems) != bad:
                failures += 1
                print(f"self-test: {rel} with {text}: expected "
                      f"{'a violation' if bad else 'none'}, got {problems or 'none'}")
    print(f"layering self-test: {len(cases) - failures}/{len(cases)} cases as expected")
    return 1 if failures else 0


def main():
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parent.parent)
    problems, scanned = check_tree(root)
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
