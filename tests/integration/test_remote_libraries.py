"""libcurl and libnbd are loaded on first use, not linked (issue 33,
io/remote/lazy_library.h): with both hidden (a private mount namespace binds
/dev/null over them) qcowfs still starts and reads a local image, and a URL
fails with a message naming the library and its package.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

from qcowfs_testlib import helpers


def library_file(soname: str) -> str:
    out = helpers.run(["ldconfig", "-p"]).stdout.decode()
    m = re.search(rf"^\s*{re.escape(soname)} \(libc6,x86-64\) => (\S+)$", out, re.M)
    assert m, f"{soname} not in the ld.so cache"
    return os.path.realpath(m.group(1))


def test_missing_libcurl_and_libnbd_are_named(tmp_path: Path) -> None:
    image = tmp_path / "local.qcow2"
    helpers.qemu_img("create", "-q", "-f", "qcow2", str(image), "1M")
    hide = " && ".join(f"mount --bind /dev/null {library_file(so)}" for so in ("libcurl.so.4", "libnbd.so.0"))
    qcowfs = helpers.qcowfs_bin()
    script = (f"{hide} && {qcowfs} info --json {image} && "
              f"! {qcowfs} info http://127.0.0.1:9/x.qcow2 && ! {qcowfs} info nbd://127.0.0.1:9/x")
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                       capture_output=True, timeout=60)
    err = r.stderr.decode()
    assert r.returncode == 0, err
    assert json.loads(r.stdout)["virtual-size"] == 1024 * 1024, r.stdout
    assert "cannot load libcurl.so.4 (is the libcurl4 package installed?)" in err, err
    assert "http://127.0.0.1:9/x.qcow2: cannot load libcurl.so.4" in err, err
    assert "nbd://127.0.0.1:9/x: cannot load libnbd.so.0 (is the libnbd0 package installed?)" in err, err
