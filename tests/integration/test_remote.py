"""Images served over HTTP(S) (issue 33): a URL as the mount's IMAGE, for
`qcowfs info`/`map` and as an overlay's backing file.

nginx (Debian's nginx-light) is started by the module fixture on 127.0.0.1, on
free ports, with its config, TLS certificate (from a CA this test makes with
openssl) and served files in a temporary directory, and stopped at the end.
QEMU is the referee: bytes are compared with `qemu-img convert -O raw` of the
local file, and QEMU reads the overlay through its own curl driver.
"""

from __future__ import annotations

import contextlib
import email.utils
import errno
import hashlib
import http.server
import json
import mmap
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

import pytest

from qcowfs_testlib import format_helpers as fh
from qcowfs_testlib import helpers

MiB = 1024 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Nginx:
    """One nginx serving root/www over http and https on loopback."""

    def __init__(self, root: Path):
        self.root = root
        self.port = free_port()
        self.tls_port = free_port()
        self.proc: subprocess.Popen | None = None
        (root / "tmp").mkdir()
        conf = root / "nginx.conf"
        temps = "".join(f"  {k}_temp_path {root}/tmp/{k};\n" for k in
                        ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        conf.write_text(f"""daemon off;
user root;
worker_processes 1;
pid {root}/nginx.pid;
error_log {root}/error.log;
events {{ worker_connections 64; }}
http {{
  access_log off;
  default_type application/octet-stream;
{temps}  server {{
    listen 127.0.0.1:{self.port};
    listen 127.0.0.1:{self.tls_port} ssl;
    ssl_certificate {root}/server.crt;
    ssl_certificate_key {root}/server.key;
    root {root}/www;
    location /forbidden/ {{ return 403; }}
    location /private/ {{
      if ($http_authorization != "Bearer s3cr3t-t0ken") {{ return 401; }}
      if ($http_x_tenant != "qcowfs") {{ return 401; }}
      alias {root}/www/;
    }}
    location /slow/ {{ alias {root}/www/; limit_rate 16k; }}
  }}
}}
""")
        self.conf = conf

    def url(self, name: str, tls: bool = False) -> str:
        return f"https://127.0.0.1:{self.tls_port}/{name}" if tls else f"http://127.0.0.1:{self.port}/{name}"

    def start(self) -> None:
        self.proc = subprocess.Popen(["nginx", "-c", str(self.conf), "-p", str(self.root), "-e",
                                      str(self.root / "error.log")], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"nginx exited: {self.proc.stderr.read().decode()}"
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2):
                return
            time.sleep(0.02)
        raise AssertionError("nginx did not start listening")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self.proc = None


def make_tls(root: Path) -> None:
    """A CA and a server certificate for 127.0.0.1 signed by it (EC keys: fast)."""
    def ssl(*args):
        helpers.run(["openssl", *args])
    ssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
        "-subj", "/CN=qcowfs test CA", "-keyout", root / "ca.key", "-out", root / "ca.crt")
    ssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-subj", "/CN=127.0.0.1", "-keyout", root / "server.key", "-out", root / "server.csr")
    (root / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    ssl("x509", "-req", "-in", root / "server.csr", "-CA", root / "ca.crt", "-CAkey", root / "ca.key",
        "-CAcreateserial", "-days", "2", "-extfile", root / "san.ext", "-out", root / "server.crt")


def make_images(www: Path, work: Path) -> None:
    """A 4 MiB raw disk (data, zeros, a hole) and qcow2/VMDK/VHDX copies of it."""
    raw = www / "disk.raw"
    with open(raw, "wb") as f:
        f.truncate(4 * MiB)
        for i, off in enumerate(range(0, 4 * MiB, 192 * 1024)):
            f.seek(off)
            f.write(os.urandom(40 * 1024) if i % 3 else bytes([i]) * 60 * 1024)
    helpers.qemu_img("convert", "-f", "raw", "-O", "qcow2", "-c", "-o", "extended_l2=on,cluster_size=64k",
                     raw, www / "disk.qcow2")
    helpers.qemu_img("convert", "-f", "raw", "-O", "vmdk", raw, www / "disk.vmdk")
    helpers.qemu_img("convert", "-f", "raw", "-O", "vhdx", raw, www / "disk.vhdx")
    for name in ("disk.qcow2", "disk.vmdk", "disk.vhdx"):
        helpers.convert_to_raw(www / name, work / f"{name}.ref", fmt=name.split(".")[1])


@pytest.fixture(scope="module")
def site():
    root = Path(tempfile.mkdtemp(prefix="qcowfs-remote-", dir=os.environ.get("QCOWFS_TEST_TMP", "/var/tmp")))
    (root / "www").mkdir()
    server = Nginx(root)
    try:
        make_tls(root)
        make_images(root / "www", root)
        server.start()
        yield server
    finally:
        server.stop()
        helpers.cleanup_mounts_under(root)
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def mount_url(url: str, target: Path, opts=(), env=None):
    """qcowfs -f [-o opts] URL target; yields the raw view's path (target)."""
    target.touch()
    argv = [helpers.qcowfs_bin(), "-f", *(["-o", ",".join(opts)] if opts else []), url, str(target)]
    log = target.with_suffix(".log")
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env)
    try:
        deadline = time.monotonic() + 20
        while not helpers.is_fuse_mounted(target):
            assert proc.poll() is None, f"qcowfs exited {proc.returncode}: {log.read_text()}"
            assert time.monotonic() < deadline, f"no mount after 20 s: {log.read_text()}"
            time.sleep(0.02)
        yield target
    finally:
        if helpers.is_fuse_mounted(target):
            helpers.unmount(target)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, f"qcowfs exited {proc.returncode}: {log.read_text()}"


def qcowfs_tool(*args, env_opts: str | None = None, check=True, extra_env=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, **(extra_env or {}))
    env.pop("QCOWFS_REMOTE_OPTIONS", None)
    if env_opts is not None:
        env["QCOWFS_REMOTE_OPTIONS"] = env_opts
    proc = subprocess.run([helpers.qcowfs_bin(), *map(str, args)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, env=env, timeout=60)
    if check:
        assert proc.returncode == 0, f"qcowfs {args}: {proc.returncode}: {proc.stderr.decode()}"
    return proc


@pytest.mark.parametrize("name", ["disk.qcow2", "disk.vmdk", "disk.vhdx"])
def test_formats_over_http_read_as_qemu_does(site, workdir, name):
    url = site.url(name)
    with mount_url(url, workdir / "view", ["remote-block-size=64K"]) as view:
        assert helpers.files_equal(view, site.root / f"{name}.ref")
    info = json.loads(qcowfs_tool("info", "--output=json", url).stdout)
    ref = helpers.qemu_img_info(site.root / "www" / name, fmt=name.split(".")[1])
    assert (info["format"], info["virtual-size"]) == (ref["format"], ref["virtual-size"])
    # The same map as of the local file (the URL only changes where bytes come from).
    local = qcowfs_tool("map", "--output=json", site.root / "www" / name).stdout
    assert qcowfs_tool("map", "--output=json", url).stdout == local
    assert "No errors were found" in qcowfs_tool("check", url).stdout.decode()


def test_https_verifies_the_server(site, workdir):
    url = site.url("disk.qcow2", tls=True)
    refused = qcowfs_tool("info", url, env_opts="", check=False)
    assert refused.returncode != 0 and "certificate" in refused.stderr.decode().lower(), refused.stderr
    assert qcowfs_tool("info", url, env_opts="sslverify=off").returncode == 0
    # The right CA but the wrong name (the certificate is for 127.0.0.1 only): refused too.
    wrong_name = url.replace("127.0.0.1", "localhost")
    refused = qcowfs_tool("info", wrong_name, env_opts=f"cafile={site.root / 'ca.crt'}", check=False)
    assert refused.returncode != 0 and "certificate" in refused.stderr.decode().lower(), refused.stderr
    assert qcowfs_tool("info", wrong_name, env_opts="sslverify=off").returncode == 0
    with mount_url(url, workdir / "view", [f"cafile={site.root / 'ca.crt'}"]) as view:
        assert helpers.files_equal(view, site.root / "disk.qcow2.ref")


@pytest.mark.parametrize("name,answer", [("nope.qcow2", "HTTP 404"), ("forbidden/disk.qcow2", "HTTP 403")])
def test_refused_object_is_a_clear_error(site, name, answer):
    url = site.url(name)
    proc = qcowfs_tool("info", url, check=False)
    err = proc.stderr.decode()
    assert proc.returncode != 0 and answer in err and url in err, err


def test_token_and_headers_from_files(site, workdir):
    (workdir / "token").write_text("s3cr3t-t0ken\n")
    (workdir / "headers").write_text("# sent with every request\nX-Tenant: qcowfs\n")
    url = site.url("private/disk.qcow2")
    opts = f"token-file={workdir / 'token'},header-file={workdir / 'headers'}"
    info = json.loads(qcowfs_tool("info", "--output=json", url, env_opts=opts).stdout)
    assert info["virtual-size"] == 4 * MiB
    refused = qcowfs_tool("info", url, env_opts=f"token-file={workdir / 'token'}", check=False)
    assert refused.returncode != 0 and "HTTP 401" in refused.stderr.decode(), refused.stderr


def test_slow_server_times_out(site, workdir):
    # nginx sends 16 KiB/s here: a 256 KiB read takes 16 s, past remote-timeout=2 (a 4 KiB one,
    # fetched alone, would not).
    opts = ["format=raw", "remote-timeout=2", "remote-readahead=0", "remote-block-size=256K"]
    with mount_url(site.url("slow/disk.raw"), workdir / "view", opts) as view:
        t0 = time.monotonic()
        with pytest.raises(OSError) as e:
            read_at(view, 2 * MiB, 256 * 1024)
        elapsed = time.monotonic() - t0
        assert e.value.errno == errno.EIO
        assert elapsed < 10, f"EIO after {elapsed:.1f} s"  # generous bound for a loaded machine


def test_local_overlay_on_http_base(site, workdir):
    base = site.url("disk.qcow2")
    overlay = workdir / "overlay.qcow2"
    qcowfs_tool("create", "-f", "qcow2", "-b", base, "-F", "qcow2", overlay)
    assert helpers.qemu_img_info(overlay)["backing-filename"] == base
    with mount_url(str(overlay), workdir / "view", ["rw"]) as view:
        helpers.files_equal(view, site.root / "disk.qcow2.ref")
        helpers.run(["fio", "--name=v", f"--filename={view}", "--rw=randwrite", "--bs=4k", "--size=1M",
                     "--offset=1M", "--verify=crc32c", "--do_verify=1", "--ioengine=psync", "--randseed=7"],
                    timeout=120)
        shown = helpers.sha256_file(view)
    helpers.qemu_img_check(overlay)
    # QEMU reads the overlay (and its base, through its curl driver) the same.
    qemu_view = helpers.convert_to_raw(overlay, workdir / "qemu.raw", fmt="qcow2")
    assert helpers.sha256_file(qemu_view) == shown


def read_at(path: Path, off: int, n: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, n, off)
    finally:
        os.close(fd)


def test_server_stopped_then_back(site, workdir):
    ref = (site.root / "www" / "disk.raw").read_bytes()
    opts = ["format=raw", "remote-timeout=2", "remote-readahead=0", "remote-block-size=64K"]
    with mount_url(site.url("disk.raw"), workdir / "view", opts) as view:
        assert read_at(view, 0, 65536) == ref[:65536]
        site.stop()
        try:
            t0 = time.monotonic()
            with pytest.raises(OSError) as e:
                read_at(view, 3 * MiB, 65536)
            elapsed = time.monotonic() - t0
            assert e.value.errno == errno.EIO
            # remote-timeout=2: the bound is generous for a loaded machine.
            assert elapsed < 10, f"EIO after {elapsed:.1f} s"
            assert read_at(view, 0, 65536) == ref[:65536]  # still serving
        finally:
            site.start()
        assert read_at(view, 3 * MiB, 65536) == ref[3 * MiB:3 * MiB + 65536]


def test_object_replaced_under_the_mount(site, workdir):
    www = site.root / "www"
    old = os.urandom(2 * MiB)
    (www / "swap.raw").write_bytes(old)
    opts = ["format=raw", "remote-readahead=0", "remote-block-size=64K", "remote-timeout=5"]
    with mount_url(site.url("swap.raw"), workdir / "view", opts) as view:
        assert read_at(view, 0, 65536) == old[:65536]
        new = workdir / "new.raw"
        new.write_bytes(os.urandom(2 * MiB))  # same size: only the ETag tells
        st = os.stat(www / "swap.raw")
        os.utime(new, (st.st_atime + 10, st.st_mtime + 10))
        os.replace(new, www / "swap.raw")
        with pytest.raises(OSError) as e:
            read_at(view, MiB, 65536)
        assert e.value.errno == errno.EIO
    log = (workdir / "view.log").read_text()
    assert site.url("swap.raw") in log and "changed on the server" in log, log


@contextlib.contextmanager
def qemu_nbd(image: Path, sock: Path, *args, procs: list | None = None):
    """qemu-nbd exporting image's bytes (-f raw) as 'exp' on a unix socket (its Popen added to procs)."""
    proc = subprocess.Popen(["qemu-nbd", "-f", "raw", "-t", "-e", "4", "-x", "exp", "-k", str(sock), *args,
                             str(image)], stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if procs is not None:
        procs.append(proc)
    try:
        deadline = time.monotonic() + 10
        while not sock.exists():
            assert proc.poll() is None, f"qemu-nbd exited: {proc.stderr.read().decode()}"
            assert time.monotonic() < deadline, "qemu-nbd did not listen"
            time.sleep(0.02)
        yield f"nbd+unix:///exp?socket={sock}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def lseek(path: Path, off: int, whence: int) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.lseek(fd, off, whence)
    finally:
        os.close(fd)


def test_nbd_read_write_and_holes(site, workdir):
    disk = workdir / "disk.raw"
    with open(disk, "wb") as f:  # data at [0, 1M) and [2M, 3M), holes elsewhere up to 8M
        f.truncate(8 * MiB)
        f.write(os.urandom(MiB))
        f.seek(2 * MiB)
        f.write(os.urandom(MiB))
    expected = bytearray(disk.read_bytes())
    pattern = os.urandom(MiB)
    status_file = workdir / "status.json"
    with qemu_nbd(disk, workdir / "nbd.sock") as uri:
        with mount_url(uri, workdir / "view", ["format=raw", "rw", f"status-file={status_file}"]) as view:
            assert helpers.files_equal(view, disk)
            # A 1 MiB read (O_DIRECT: one FUSE read) goes out as four 256 KiB commands together.
            at_mount = read_status(status_file)
            os.kill(at_mount["pid"], signal.SIGUSR1)  # the counters after files_equal's reads
            before = read_status(status_file, at_mount["sequence"])
            assert direct_pread(view, 2 * MiB - 4096, MiB) == expected[2 * MiB - 4096:3 * MiB - 4096]
            os.kill(before["pid"], signal.SIGUSR1)
            after = read_status(status_file, before["sequence"])
            [r0], [r1] = before["remotes"], after["remotes"]
            assert (r1["requests"] - r0["requests"], r1["bytes_fetched"] - r0["bytes_fetched"]) == (4, MiB)
            # base:allocation block status gives SEEK_DATA/SEEK_HOLE as the host file has them.
            seeks = [(0, os.SEEK_HOLE), (MiB + 5, os.SEEK_DATA), (2 * MiB, os.SEEK_HOLE), (3 * MiB, os.SEEK_HOLE)]
            assert [lseek(view, o, w) for o, w in seeks] == [lseek(disk, o, w) for o, w in seeks]
            assert lseek(view, 0, os.SEEK_HOLE) == MiB  # the file system kept the holes
            fd = os.open(view, os.O_WRONLY)
            try:
                assert os.pwrite(fd, pattern, MiB + 4096) == MiB
                os.fsync(fd)
            finally:
                os.close(fd)
        expected[MiB + 4096:2 * MiB + 4096] = pattern
        assert disk.read_bytes() == bytes(expected)
    # Any format over NBD: the qcow2's bytes exported raw, opened as qcow2 by qcowfs.
    with qemu_nbd(site.root / "www" / "disk.qcow2", workdir / "q.sock", "-r") as uri:
        with mount_url(uri, workdir / "qview") as view:
            assert helpers.files_equal(view, site.root / "disk.qcow2.ref")


S3_KEYS = {"AWS_ACCESS_KEY_ID": "S3RVER", "AWS_SECRET_ACCESS_KEY": "S3RVER"}  # s3rver's own


@pytest.fixture(scope="module")
def s3_endpoint(site):
    """s3rver (npm) on loopback with bucket 'b' holding disk.qcow2, put there signed by curl."""
    port = free_port()
    (site.root / "s3").mkdir()
    proc = subprocess.Popen(["s3rver", "-d", str(site.root / "s3"), "-a", "127.0.0.1", "-p", str(port), "-s",
                             "--configure-bucket", "b"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None, f"s3rver exited: {proc.stderr.read().decode()}"
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                break
            assert time.monotonic() < deadline, "s3rver did not listen"
            time.sleep(0.05)
        helpers.run(["curl", "-sSf", "--aws-sigv4", "aws:amz:us-east-1:s3", "--user", "S3RVER:S3RVER",
                     "-H", "x-amz-content-sha256: UNSIGNED-PAYLOAD", "-T", site.root / "www" / "disk.qcow2",
                     f"{endpoint}/b/disk.qcow2"])
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_s3_signed_reads(site, s3_endpoint, workdir):
    env = dict(os.environ, **S3_KEYS)
    with mount_url("s3://b/disk.qcow2", workdir / "view", [f"s3-endpoint={s3_endpoint}"], env=env) as view:
        assert helpers.files_equal(view, site.root / "disk.qcow2.ref")
    wrong = qcowfs_tool("info", "s3://b/disk.qcow2", env_opts=f"s3-endpoint={s3_endpoint}", check=False,
                        extra_env={**S3_KEYS, "AWS_ACCESS_KEY_ID": "WRONG"})
    err = wrong.stderr.decode()
    assert wrong.returncode != 0 and "refused the credentials" in err, err
    unsigned = qcowfs_tool("info", "s3://b/disk.qcow2", env_opts=f"s3-endpoint={s3_endpoint}", check=False,
                           extra_env={"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""})
    assert unsigned.returncode != 0 and "no S3 credentials" in unsigned.stderr.decode()


# --- statistics (SIGUSR1, status-file=) ----------------------------------------------------------


def read_status(path: Path, newer_than: int = 0, timeout: float = 10) -> dict:
    """The status file once its sequence passed newer_than (rewritten on SIGUSR1)."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            status = json.loads(path.read_text())
            if status["sequence"] > newer_than:
                return status
        assert time.monotonic() < deadline, f"status file {path} not rewritten"
        time.sleep(0.02)


def uncached_pread(path: Path, off: int, n: int) -> bytes:
    """A read that reaches the daemon: no kernel readahead, the page cache dropped first."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return os.pread(fd, n, off)
    finally:
        os.close(fd)


def direct_pread(path: Path, off: int, n: int) -> bytes:
    """An O_DIRECT read (off and n multiples of 4 KiB): the daemon sees it as one read of up to 1 MiB."""
    buf = mmap.mmap(-1, n)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        got = os.preadv(fd, [buf], off)
    finally:
        os.close(fd)
    return bytes(buf[:got])


def test_statistics_count_a_miss_then_a_hit(site, workdir):
    ref = (site.root / "www" / "disk.raw").read_bytes()
    status_file = workdir / "status.json"
    opts = ["format=raw", "remote-readahead=0", "remote-block-size=64K", f"status-file={status_file}"]
    url = site.url("disk.raw")
    with mount_url(url, workdir / "view", opts) as view:
        first = read_status(status_file)
        [remote] = first["remotes"]
        assert (remote["url"], remote["protocol"], remote["size"]) == (url, "http", len(ref))
        assert remote["etag"] and remote["last_modified"]

        def after_signal(prev: dict) -> dict:
            os.kill(prev["pid"], signal.SIGUSR1)
            now = read_status(status_file, prev["sequence"])
            return now

        assert uncached_pread(view, MiB + 4096, 4096) == ref[MiB + 4096:MiB + 8192]
        missed = after_signal(first)
        m0, m1 = first["remotes"][0], missed["remotes"][0]
        misses = m1["cache_misses"] - m0["cache_misses"]
        assert misses >= 1
        assert m1["requests"] - m0["requests"] == misses
        # Two network threads (remote-threads= default): the identity request went to the first,
        # the next request to the second (the one with fewer bytes in flight, round robin on a tie).
        per_thread = m1["requests_per_thread"]
        assert len(per_thread) == 2 and sum(per_thread) == m1["requests"], m1
        assert min(per_thread) >= 1, m1
        # A small random read fetches its 4 KiB granule, not the 64 KiB block.
        assert m1["bytes_fetched"] - m0["bytes_fetched"] == misses * 4096
        assert uncached_pread(view, MiB + 4096, 4096) == ref[MiB + 4096:MiB + 8192]  # the same granule
        hit = after_signal(missed)
        m2 = hit["remotes"][0]
        assert m2["cache_hits"] > m1["cache_hits"]
        assert (m2["cache_misses"], m2["requests"], m2["bytes_fetched"], m2["requests_per_thread"]) == \
            (m1["cache_misses"], m1["requests"], m1["bytes_fetched"], m1["requests_per_thread"])
        assert (m2["retries"], m2["errors"], m2["in_flight_bytes"]) == (0, 0, 0)
    log = (workdir / "view.log").read_text()
    # At mount: size, identity and settings; on SIGUSR1: the counters.
    assert re.search(rf"{re.escape(url)}: {len(ref)} bytes over http, ETag \S+, Last-Modified .*blocks of 64 KiB",
                     log), log
    assert f"{url}: {m2['cache_hits']} block hits, {m2['cache_misses']} misses" in log, log


def test_password_and_query_stay_out_of_logs_status_and_mount_table(site, workdir):
    # nginx ignores the user, password and query: the URL reads disk.raw, and every place that shows
    # it (the mount table every user reads, the log, the status file, an error) shows it without them.
    url = site.url("disk.raw").replace("http://", "http://reader:pa55word@") + "?X-Amz-Signature=51gnature"
    shown = site.url("disk.raw").replace("http://", "http://reader@")
    status_file = workdir / "status.json"
    with mount_url(url, workdir / "view", ["format=raw", f"status-file={status_file}"]) as view:
        assert direct_pread(view, 0, 4096) == (site.root / "www" / "disk.raw").read_bytes()[:4096]
        mounts = Path("/proc/mounts").read_text()
        [line] = [l for l in mounts.splitlines() if f" {view} " in l]
        assert line.split()[0] == shown, line
        status = read_status(status_file)
        assert status["remotes"][0]["url"] == shown, status
    log = (workdir / "view.log").read_text()
    assert shown in log, log
    missing = qcowfs_tool("info", url.replace("disk.raw", "nope.raw"), check=False)
    err = missing.stderr.decode()
    assert missing.returncode != 0 and "HTTP 404" in err and shown.replace("disk.raw", "nope.raw") in err, err
    for text in (mounts, log, json.dumps(status), err):
        assert "pa55word" not in text and "51gnature" not in text


# --- faults: 416, a truncated body ---------------------------------------------------------------


def test_range_past_a_shrunken_object_is_eio(site, workdir):
    www = site.root / "www"
    old = os.urandom(2 * MiB)
    (www / "shrink.raw").write_bytes(old)
    opts = ["format=raw", "remote-readahead=0", "remote-block-size=64K", "remote-timeout=5"]
    with mount_url(site.url("shrink.raw"), workdir / "view", opts) as view:
        small = workdir / "small.raw"
        small.write_bytes(os.urandom(192 * 1024))
        os.replace(small, www / "shrink.raw")
        with pytest.raises(OSError) as e:
            read_at(view, MiB, 4096)  # nginx: 416 Range Not Satisfiable (a read error is not logged)
        assert e.value.errno == errno.EIO
        with pytest.raises(OSError) as e:  # within the new size: a changed object, not new bytes
            read_at(view, 128 * 1024, 4096)
        assert e.value.errno == errno.EIO
        # the first block came with the identity at open: the pinned object's bytes, not the new ones
        assert read_at(view, 0, 4096) == old[:4096]


class MockServer:
    """An HTTP server on loopback, in a thread of the test, serving one object
    with ranges; it can cut bodies short and check S3 signatures with botocore
    (the SigV4 referee, independent of libcurl's signing)."""

    def __init__(self, data: bytes, path: str, keys: dict | None = None, region: str = "us-east-1"):
        self.data, self.path, self.keys, self.region = data, path, keys, region
        self.truncate = False
        self.requests: list[str] = []
        self.refusals: list[str] = []
        mock = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                mock.requests.append(self.headers.get("Range", ""))
                if mock.keys is not None:
                    problem = mock.check_signature(self)
                    if problem:
                        mock.refusals.append(problem)
                        return self.answer(403, s3_error(problem, f"{problem} (mock)").encode(), {})
                if self.path != mock.path:
                    return self.answer(404, s3_error("NoSuchKey", self.path).encode(), {})
                m = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range", ""))
                if not m:
                    return self.answer(200, mock.data, {})
                first, last = int(m[1]), min(int(m[2]), len(mock.data) - 1)
                body = mock.data[first:last + 1]
                headers = {"Content-Range": f"bytes {first}-{last}/{len(mock.data)}", "ETag": '"mock-1"',
                           "Last-Modified": email.utils.formatdate(1e9, usegmt=True)}
                if mock.truncate:  # promise the whole range, send half, close
                    self.send_response(206)
                    for k, v in {**headers, "Content-Length": str(len(body))}.items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(body[:len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.answer(206, body, headers)

            def answer(self, code, body, headers):
                self.send_response(code)
                for k, v in {**headers, "Content-Length": str(len(body))}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def check_signature(self, req) -> str:
        """"" when req carries a valid SigV4 signature of one of self.keys (by botocore), else the S3 error code."""
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest
        from botocore.credentials import Credentials
        auth = req.headers.get("Authorization", "")
        m = re.fullmatch(r"AWS4-HMAC-SHA256 Credential=([^/]+)/(\d{8})/([^/]+)/s3/aws4_request, "
                         r"SignedHeaders=([^,]+), Signature=([0-9a-f]{64})", auth)
        if not m or m[3] != self.region:
            return "AuthorizationHeaderMalformed"
        if m[1] not in self.keys:
            return "InvalidAccessKeyId"
        signed = m[4].split(";")
        if "host" not in signed or "x-amz-date" not in signed:
            return "AccessDenied"
        request = AWSRequest(method="GET", url=f"http://{req.headers['Host']}{req.path}",
                             headers={h: req.headers[h] for h in signed})
        request.context["timestamp"] = req.headers["x-amz-date"]
        signer = S3SigV4Auth(Credentials(m[1], self.keys[m[1]]), "s3", self.region)
        canonical = signer.canonical_request(request)
        want = signer.signature(signer.string_to_sign(request, canonical), request)
        return "" if want == m[5] else "SignatureDoesNotMatch"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def s3_error(code: str, message: str) -> str:
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            f'<RequestId>0</RequestId></Error>')


def test_truncated_body_is_retried_then_eio(site, workdir):
    data = (site.root / "www" / "disk.raw").read_bytes()
    mock = MockServer(data, "/disk.raw")
    try:
        opts = ["format=raw", "remote-readahead=0", "remote-block-size=64K", "remote-timeout=2"]
        with mount_url(f"{mock.endpoint}/disk.raw", workdir / "view", opts) as view:
            assert read_at(view, 0, 4096) == data[:4096]
            mock.truncate = True
            before = len(mock.requests)
            t0 = time.monotonic()
            with pytest.raises(OSError) as e:  # never short data: an error
                read_at(view, 2 * MiB, 4096)
            elapsed = time.monotonic() - t0
            assert e.value.errno == errno.EIO
            assert elapsed < 10, f"EIO after {elapsed:.1f} s"  # remote-timeout=2; generous when loaded
            tried = [r for r in mock.requests[before:] if r.startswith(f"bytes={2 * MiB}-")]
            assert len(tried) >= 2, mock.requests[before:]  # retried before giving up
            mock.truncate = False
            assert read_at(view, 2 * MiB, 4096) == data[2 * MiB:2 * MiB + 4096]
    finally:
        mock.close()


def test_open_fetches_the_first_block_in_its_identity_request(site, workdir):
    """Issue 33: mount + a read within the first block is one request (identity and block together)."""
    data = (site.root / "www" / "disk.qcow2").read_bytes()
    mock = MockServer(data, "/disk.qcow2")
    try:
        opts = ["format=qcow2", "remote-readahead=0", "remote-block-size=256K"]
        with mount_url(f"{mock.endpoint}/disk.qcow2", workdir / "view", opts):
            # probe, header and L1 of the mount all come from the identity request's block
            assert mock.requests == [f"bytes=0-{256 * 1024 - 1}"], mock.requests
    finally:
        mock.close()
    raw = (site.root / "www" / "disk.raw").read_bytes()
    mock = MockServer(raw, "/disk.raw")
    try:
        opts = ["format=raw", "remote-readahead=0", "remote-block-size=64K"]
        with mount_url(f"{mock.endpoint}/disk.raw", workdir / "view", opts) as view:
            assert read_at(view, 0, 4096) == raw[:4096]
            assert read_at(view, 60 * 1024, 4096) == raw[60 * 1024:64 * 1024]
            assert mock.requests == ["bytes=0-65535"], mock.requests
            assert read_at(view, 64 * 1024, 4096) == raw[64 * 1024:68 * 1024]  # past it: fetched
            assert [r.split("-")[0] for r in mock.requests[1:]] == [f"bytes={64 * 1024}"], mock.requests
    finally:
        mock.close()


# --- S3: credentials files, key encoding, refusals -----------------------------------------------


ODD_KEY = "dir/my disk+1 (cop\u00e9) &=?#%20~.qcow2"


def s3_env(workdir: Path, key_id: str, secret: str, profile: str = "qcowfs") -> dict:
    """An environment with no AWS keys, whose credentials file holds key_id/secret under [profile]."""
    creds = workdir / "aws-credentials"
    creds.write_text(f"[default]\naws_access_key_id = NOT-THIS-ONE\naws_secret_access_key = x\n\n"
                     f"[{profile}]\naws_access_key_id = {key_id}\naws_secret_access_key = {secret}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_SHARED_CREDENTIALS_FILE=str(creds), AWS_PROFILE=profile, AWS_CONFIG_FILE=str(workdir / "none"))
    return env


def test_s3_credentials_file_key_encoding_and_signature(site, workdir):
    from botocore.utils import percent_encode
    data = (site.root / "www" / "disk.qcow2").read_bytes()
    secret = "s3cr3t/with+odd=chars"
    # The path an AWS SDK sends for the key (botocore's encoding of a {Key+} label).
    mock = MockServer(data, "/b/" + percent_encode(ODD_KEY, safe="/~"), keys={"AKIDQCOWFS": secret})
    try:
        name = f"s3://b/{ODD_KEY}"
        env = s3_env(workdir, "AKIDQCOWFS", secret)
        opts = [f"s3-endpoint={mock.endpoint}"]
        with mount_url(name, workdir / "view", opts, env=env) as view:
            assert helpers.files_equal(view, site.root / "disk.qcow2.ref")
        assert not mock.refusals, mock.refusals
        # A wrong secret: the server's own words (the XML body's code) in the message.
        proc = subprocess.run([helpers.qcowfs_bin(), "info", name], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**s3_env(workdir, "AKIDQCOWFS", "wrong"), "QCOWFS_REMOTE_OPTIONS": opts[0]},
                              timeout=60)
        err = proc.stderr.decode()
        assert proc.returncode != 0 and "HTTP 403 SignatureDoesNotMatch" in err and "refused the credentials" in err, err
        assert "aws-credentials [qcowfs]" in err, err  # where the keys came from
    finally:
        mock.close()


def test_s3rver_credentials_file_and_unknown_key(site, s3_endpoint, workdir):
    key = "dir/a b+c.qcow2"
    helpers.run(["curl", "-sSf", "--aws-sigv4", "aws:amz:us-east-1:s3", "--user", "S3RVER:S3RVER",
                 "-H", "x-amz-content-sha256: UNSIGNED-PAYLOAD", "-T", site.root / "www" / "disk.qcow2",
                 f"{s3_endpoint}/b/{urllib.parse.quote(key, safe='/')}"])
    opts = f"s3-endpoint={s3_endpoint}"
    run = lambda env: subprocess.run([helpers.qcowfs_bin(), "info", "--output=json", f"s3://b/{key}"],  # noqa: E731
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env={**env, "QCOWFS_REMOTE_OPTIONS": opts}, timeout=60)
    ok = run(s3_env(workdir, "S3RVER", "S3RVER"))
    assert ok.returncode == 0, ok.stderr.decode()
    assert json.loads(ok.stdout)["virtual-size"] == 4 * MiB
    unknown = run(s3_env(workdir, "NOSUCHKEY", "S3RVER"))
    err = unknown.stderr.decode()
    assert unknown.returncode != 0 and "InvalidAccessKeyId" in err, err


# --- LUKS over http, an overlay on an https base -------------------------------------------------

PASS = "correct horse"


def test_luks_qcow2_over_http_reads_as_qemu_does(site, workdir):
    image = site.root / "www" / "luks.qcow2"
    if not image.exists():
        for attempt in range(8):  # see test_encryption.qemu_img_create: a calibration that can miss a tick
            r = helpers.run(["qemu-img", "create", "-q", "--object", f"secret,id=s0,data={PASS}", "-f", "qcow2", "-o",
                             "encrypt.format=luks,encrypt.key-secret=s0,encrypt.iter-time=10,encrypt.hash-alg=sha512",
                             image, str(4 * MiB)], check=False, env=helpers.fast_kdf_calibration_env())
            if r.returncode == 0:
                break
            assert b"accurate CPU usage" in r.stderr + r.stdout and attempt < 7, r.stderr
        cmds = fh.scattered_writes(4 * MiB, 64 * 1024)
        helpers.run(["qemu-io", "--object", f"secret,id=s0,data={PASS}", "--image-opts",
                     *[a for c in cmds for a in ("-c", c)],
                     f"driver=qcow2,encrypt.key-secret=s0,file.filename={image}"])
    ref = workdir / "luks.ref"
    helpers.run(["qemu-img", "convert", "--object", f"secret,id=s0,data={PASS}", "--image-opts",
                 f"driver=qcow2,encrypt.key-secret=s0,file.filename={image}", "-O", "raw", ref])
    (workdir / "pass").write_text(PASS)
    with mount_url(site.url("luks.qcow2"), workdir / "view", [f"key-file={workdir / 'pass'}"]) as view:
        assert helpers.files_equal(view, ref)


def test_local_overlay_on_https_base(site, workdir):
    base = site.url("disk.qcow2", tls=True)
    overlay = workdir / "overlay.qcow2"
    ca = f"cafile={site.root / 'ca.crt'}"
    qcowfs_tool("create", "-f", "qcow2", "-b", base, "-F", "qcow2", overlay, env_opts=ca)
    pattern = os.urandom(256 * 1024)
    with mount_url(str(overlay), workdir / "view", ["rw", ca]) as view:
        fd = os.open(view, os.O_WRONLY)
        try:
            assert os.pwrite(fd, pattern, 3 * MiB + 4096) == len(pattern)
            os.fsync(fd)
        finally:
            os.close(fd)
        shown = helpers.sha256_file(view)
    # QEMU checks and reads the overlay, its base over https through its curl driver (which knows
    # no cafile: sslverify=off there).
    qemu_opts = (f"driver=qcow2,file.filename={overlay},backing.driver=qcow2,backing.file.driver=https,"
                 f"backing.file.url={base},backing.file.sslverify=off")
    check = json.loads(helpers.run(["qemu-img", "check", "--output=json", "--image-opts", qemu_opts]).stdout)
    assert not any(check.get(k, 0) for k in ("corruptions", "leaks", "check-errors")), check
    expected = bytearray((site.root / "disk.qcow2.ref").read_bytes())
    expected[3 * MiB + 4096:3 * MiB + 4096 + len(pattern)] = pattern
    assert shown == hashlib.sha256(expected).hexdigest()
    qemu_view = workdir / "qemu.raw"
    helpers.run(["qemu-img", "convert", "--image-opts", qemu_opts, "-O", "raw", qemu_view])
    assert helpers.sha256_file(qemu_view) == shown


# --- NBD: reconnecting after a lost server, nbdkit ------------------------------------------------


def nbd_read_until_ok(view: Path, off: int, n: int, timeout: float) -> tuple[bytes, float]:
    t0 = time.monotonic()
    while True:
        try:
            return read_at(view, off, n), time.monotonic() - t0
        except OSError as e:
            assert e.errno == errno.EIO, e
            assert time.monotonic() - t0 < timeout, f"no recovery within {timeout} s"
            time.sleep(0.1)


def test_nbd_reconnects_after_the_server_returns(site, workdir):
    disk = site.root / "www" / "disk.raw"
    ref = disk.read_bytes()
    sock = workdir / "nbd.sock"
    procs = []
    with contextlib.ExitStack() as stack:
        uri = stack.enter_context(qemu_nbd(disk, sock, "-r", procs=procs))
        view = stack.enter_context(mount_url(uri, workdir / "view", ["format=raw", "remote-timeout=2"]))
        assert read_at(view, 0, 65536) == ref[:65536]
        # Not answering: EIO within the timeout, then back once it answers again.
        os.kill(procs[0].pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(OSError) as e:
                read_at(view, MiB, 65536)
            assert e.value.errno == errno.EIO
            assert time.monotonic() - t0 < 10  # remote-timeout=2; generous when loaded
        finally:
            os.kill(procs[0].pid, signal.SIGCONT)
        got, _ = nbd_read_until_ok(view, MiB, 65536, timeout=15)
        assert got == ref[MiB:MiB + 65536]
        # Gone: EIO at once; a new server (nbdkit this time) on the same socket: back again.
        procs[0].terminate()
        procs[0].wait(timeout=10)
        sock.unlink(missing_ok=True)
        with pytest.raises(OSError) as e:
            read_at(view, 2 * MiB, 65536)
        assert e.value.errno == errno.EIO
        kit = subprocess.Popen(["nbdkit", "-f", "-r", "-U", str(sock), "-e", "exp", "file", f"file={disk}"],
                               stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            got, _ = nbd_read_until_ok(view, 2 * MiB, 65536, timeout=15)
            assert got == ref[2 * MiB:2 * MiB + 65536]
            assert helpers.files_equal(view, disk)
        finally:
            kit.kill()  # nbdkit waits for its clients on SIGTERM, and the mount is still up
            kit.wait(timeout=10)
    log = (workdir / "view.log").read_text()
    assert "did not answer within 2 s" in log and log.count("connected to the server again") >= 2, log


def url_control_socket(canonical: str) -> Path:
    """A URL mount's control socket (root's): 128 bits of the SHA-256 of the URL's
    canonical form (io/remote/canonical_url.h), which the caller writes out."""
    return Path("/run/qcowfs") / f"url-{hashlib.sha256(canonical.encode()).hexdigest()[:32]}.sock"


def test_live_snapshot_of_a_writable_nbd_url(workdir):
    """A qcow2 over a writable NBD export: `qcowfs snapshot -c NAME URL` is served
    live by the daemon holding the URL (found by the URL as written), with the
    sequence-stamping writers of test_live_snapshot.py; QEMU reads the result."""
    from test_live_snapshot import SIZE, SPAN, WRITERS, Writers, assert_qemu_sees_s1_as_it_was, qcowfs_snapshot
    image = workdir / "live.qcow2"
    helpers.run(["qemu-img", "create", "-q", "-f", "qcow2", image, str(SIZE)])
    # An NBD export cannot grow: the file gets room for the clusters the
    # writes and the snapshot allocate (free space a qcow2 may have at its end).
    os.truncate(image, 4 * SIZE)
    with qemu_nbd(image, workdir / "live.sock") as uri:
        # Canonical: the socket's real path, every reserved byte encoded (as curl_easy_escape).
        sock = url_control_socket(
            f"nbd+unix:///exp?socket={urllib.parse.quote(str((workdir / 'live.sock').resolve()), safe='')}")
        with mount_url(uri, workdir / "view", ["rw"]) as view:
            assert sock.is_socket()
            with Writers(view) as w:
                w.wait_for([SPAN // 2] * WRITERS)
                low = w.acked()
                r = qcowfs_snapshot("-c", "s1", uri)
                high = [n + 1 for n in w.acked()]
                assert r.returncode == 0, r.stderr.decode()
                w.wait_for([n + SPAN for n in high])
            final = w.acked()
            listing = qcowfs_snapshot("-l", uri)
            assert listing.returncode == 0 and " s1 " in listing.stdout.decode(), listing.stderr.decode()
            r = qcowfs_snapshot("--external", workdir / "new.qcow2", uri)
            assert r.returncode == 1 and "use a local overlay" in r.stderr.decode(), r.stderr.decode()
        assert not sock.exists()
    assert_qemu_sees_s1_as_it_was(image, workdir, ["s1"], low, high, final)


def test_snapshots_of_a_read_only_url(site, workdir):
    """Over HTTP: -l lists (offline, and through a mount's daemon), -c and -d
    fail with EROFS naming why, mounted or not. Another spelling of the mounted
    URL reaches its daemon; a different URL of the same bytes does not."""
    from test_live_snapshot import qcowfs_snapshot
    image = site.root / "www" / "snapped.qcow2"
    helpers.run(["qemu-img", "create", "-q", "-f", "qcow2", image, "1M"])
    helpers.run(["qemu-img", "snapshot", "-c", "base", image])
    url = site.url("snapped.qcow2")
    listing = qcowfs_snapshot("-l", url)
    assert listing.returncode == 0 and " base " in listing.stdout.decode(), listing.stderr.decode()
    r = qcowfs_snapshot("-c", "s1", url)
    assert r.returncode == 1 and "images over HTTP and S3 are read-only" in r.stderr.decode(), r.stderr.decode()
    with mount_url(url, workdir / "view"):
        assert url_control_socket(url).is_socket()
        # A snapshot added on the server since the mount opened the image: only
        # the offline path (a fresh read) lists it, the daemon lists what it holds.
        helpers.run(["qemu-img", "snapshot", "-c", "later", image])
        # Equivalent spellings (host and path as curl normalises them) meet the
        # daemon; its answers to -c and -d name the mount point.
        respelled = url.replace("127.0.0.1", "127.1").replace("/snapped", "/sub/../snapped")
        assert respelled != url
        for spelling in (url, respelled):
            listing = qcowfs_snapshot("-l", spelling)
            out = listing.stdout.decode()
            assert listing.returncode == 0 and " base " in out and " later " not in out, listing.stderr.decode()
            for args in (["-c", "s1"], ["-d", "base"]):
                r = qcowfs_snapshot(*args, spelling)
                err = r.stderr.decode()
                assert r.returncode == 1 and f"is mounted read-only on {workdir / 'view'}" in err, err
                assert args[0] == "-d" or "-30 (Read-only file system" in err, err  # EROFS, as qemu-img words it
        # The same object under a query is another URL: the offline path answers.
        listing = qcowfs_snapshot("-l", url + "?v=1")
        assert listing.returncode == 0 and " later " in listing.stdout.decode(), listing.stderr.decode()
        r = qcowfs_snapshot("-c", "s1", url + "?v=1")
        err = r.stderr.decode()
        assert r.returncode == 1 and "images over HTTP and S3 are read-only" in err and "mounted" not in err, err
    assert [line.split()[1] for line in
            helpers.run(["qemu-img", "snapshot", "-l", image]).stdout.decode().splitlines()[2:]] == ["base", "later"]
