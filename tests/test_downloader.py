"""cached_fineweb10B.py against a real HTTP server on 127.0.0.1 that answers like the hub.

The script runs as a subprocess, as users run it, with HF_ENDPOINT pointing at the server:
huggingface_hub reads its settings when imported, and nothing of it is mocked.
"""

import collections
import contextlib
import ctypes
import hashlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

import shards

SCRIPT = Path(__file__).resolve().parents[1] / "data" / "cached_fineweb10B.py"
REPO = "kjj0/fineweb10B-gpt2"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
VAL, TRAIN1, TRAIN2, TRAIN3 = "fineweb_val_000000.bin", *(f"fineweb_train_{i:06d}.bin" for i in (1, 2, 3))


class FakeHub:
    """The hub's /resolve/ endpoint on one port and its file store ("CDN") on another.

    As on huggingface.co, HEAD /resolve/ answers 302 to the CDN with the file's size, ETag
    and commit in X-Linked-Size, X-Linked-Etag and X-Repo-Commit; a different origin, so the
    client takes the metadata from the redirect and GETs the body from the CDN, which honours
    Range requests (used to resume).
    """

    def __init__(self):
        self.files = {}  # (repo id, file name) -> bytes
        self.cut = set()  # file names whose transfer dies halfway, and then for good
        self.stall = set()  # file names whose transfer stops halfway until close()
        self.stalled = threading.Semaphore(0)  # released once per transfer that has stalled
        self.release = threading.Event()  # set by close(): stalled transfers end
        self.hold = None  # (count, seconds): a body waits for `count` in flight at once, `seconds` at most
        self.in_flight = self.max_in_flight = 0  # body GETs
        self.body_gets = collections.Counter()  # file name -> GETs of its body
        self.requests = []  # (port role, method, path)
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.hub = self._serve("hub")
        self.cdn = self._serve("cdn")
        self.url = f"http://127.0.0.1:{self.hub.server_port}"

    def _serve(self, role):
        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        server.fake, server.role = self, role
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return server

    @contextlib.contextmanager
    def transfer(self):
        """Count a body GET as in flight while it is answered."""
        with self.changed:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.changed.notify_all()
            if self.hold:
                count, seconds = self.hold
                self.changed.wait_for(lambda: self.max_in_flight >= count, timeout=seconds)
        try:
            yield
        finally:
            with self.changed:
                self.in_flight -= 1

    def close(self):
        self.release.set()
        for server in (self.hub, self.cdn):
            server.shutdown()
            server.server_close()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_HEAD(self):
        self._answer(body=False)

    def do_GET(self):
        self._answer(body=True)

    def _answer(self, body):
        fake, role = self.server.fake, self.server.role
        path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
        with fake.lock:
            fake.requests.append((role, self.command, path))
        route = r"/datasets/(\w+/[\w.-]+)/resolve/main/(.+)" if role == "hub" else r"/files/(\w+/[\w.-]+)/(.+)"
        match = re.fullmatch(route, path)
        data = fake.files.get(match.groups()) if match else None
        if data is None:
            self.send_response(404)
            self.send_header("X-Error-Code", "EntryNotFound")
            self.send_header("X-Error-Message", "Entry not found")
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif role == "hub":
            repo, name = match.groups()
            self.send_response(302)
            self.send_header("Location", f"http://127.0.0.1:{fake.cdn.server_port}/files/{repo}/{name}")
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("X-Linked-Etag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("X-Linked-Size", str(len(data)))
            self.send_header("ETag", f'W/"{hashlib.sha1(data).hexdigest()}"')
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif body:
            with fake.transfer():
                self._send_file(match.group(2), data, body)
        else:
            self._send_file(match.group(2), data, body)

    def _send_file(self, name, data, body):
        fake = self.server.fake
        if body:
            with fake.lock:
                fake.body_gets[name] += 1
                attempt = fake.body_gets[name]
        if body and name in fake.cut and attempt > 1:
            self.close_connection = True  # the server is gone for this file: no answer at all
            return
        start = int(re.fullmatch(r"bytes=(\d+)-", self.headers["Range"]).group(1)) if "Range" in self.headers else 0
        self.send_response(206 if start else 200)
        self.send_header("Content-Length", str(len(data) - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        self.end_headers()
        if body and name in fake.cut:
            self.wfile.write(data[start:len(data) // 2])
            self.wfile.flush()
            self.close_connection = True  # cut: fewer bytes than Content-Length promised
        elif body and name in fake.stall:
            self.wfile.write(data[start:len(data) // 2])
            self.wfile.flush()
            fake.stalled.release()
            fake.release.wait(30)
            self.close_connection = True
        elif body:
            self.wfile.write(data[start:])


def shard_bytes(tmp_path, n_tokens, seed):
    path = tmp_path / f"served-{seed}.bin"
    shards.write_shard(path, np.random.default_rng(seed).integers(0, 50257, n_tokens))
    return path.read_bytes()


@pytest.fixture
def hub(tmp_path):
    fake = FakeHub()
    for seed, name in enumerate([VAL, TRAIN1, TRAIN2, TRAIN3]):
        fake.files[(REPO, name)] = shard_bytes(tmp_path, 1000 + 700 * seed, seed)
    yield fake
    fake.close()


def start(hub, tmp_path, *args):
    """The downloader as a running process, writing to tmp_path/out; returns (Popen, out)."""
    env = {k: v for k, v in os.environ.items()
           if not k.upper().startswith(("HF_", "HUGGINGFACE_")) and not k.lower().endswith("_proxy")}
    env.update(
        HF_ENDPOINT=hub.url,
        HF_HOME=str(tmp_path / "hf-home"),
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_ETAG_TIMEOUT="5",
        HF_HUB_DOWNLOAD_TIMEOUT="5",
        NO_PROXY="127.0.0.1",
    )
    out = tmp_path / "out"
    # Ctrl-C reaches the downloader as in a terminal even where the suite runs with SIGINT ignored
    # (a background job of a shell without job control), which the child would otherwise inherit.
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *args, "--out", str(out)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return proc, out


def run(hub, tmp_path, *args):
    proc, out = start(hub, tmp_path, *args)
    with proc:
        stdout, stderr = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), out


def assert_one_line_error(proc, *fragments):
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert errors == [lines[-1]], proc.stderr
    for fragment in fragments:
        assert fragment in errors[0]


def listing(out):
    return sorted(str(p.relative_to(out)) for p in out.rglob("*"))


def assert_served(hub, out, names):
    """`out` holds exactly `names`, each the served bytes and a valid shard."""
    assert listing(out) == sorted(names)
    for name in names:
        assert (out / name).read_bytes() == hub.files[(REPO, name)]
        assert shards.read_shard(out / name).size == shards.read_header(out / name)


def test_downloads_validates_and_then_skips(hub, tmp_path):
    proc, out = run(hub, tmp_path, "3", "--workers=4")
    assert proc.returncode == 0, proc.stderr
    names = [VAL, TRAIN1, TRAIN2, TRAIN3]
    assert_served(hub, out, names)
    assert hub.body_gets == {name: 1 for name in names}
    assert "downloading 4 shards from kjj0/fineweb10B-gpt2, 4 at a time" in proc.stdout
    assert "[4/4] " in proc.stdout and "fineweb_train_000002.bin: 2,400 tokens" in proc.stdout

    requests = len(hub.requests)
    proc, _ = run(hub, tmp_path, "3", "--workers=4")
    assert proc.returncode == 0, proc.stderr
    assert "4 of 4 shards already in" in proc.stdout
    assert len(hub.requests) == requests  # nothing was even asked for

    # A damaged file is noticed and fetched again, and only that one.
    (out / "fineweb_train_000001.bin").write_bytes(hub.files[(REPO, "fineweb_train_000001.bin")][:-2])
    proc, _ = run(hub, tmp_path, "3", "--workers=4")
    assert proc.returncode == 0, proc.stderr
    assert "fineweb_train_000001.bin: header declares 1700 tokens" in proc.stdout
    assert hub.body_gets["fineweb_train_000001.bin"] == 2 and hub.body_gets["fineweb_val_000000.bin"] == 1
    assert (out / "fineweb_train_000001.bin").read_bytes() == hub.files[(REPO, "fineweb_train_000001.bin")]


def test_a_shard_with_a_bad_header_is_rejected(hub, tmp_path):
    bad = bytearray(hub.files[(REPO, "fineweb_train_000002.bin")])
    bad[0] ^= 0xFF
    hub.files[(REPO, "fineweb_train_000002.bin")] = bytes(bad)
    proc, out = run(hub, tmp_path, "2")
    assert_one_line_error(proc, "error: fineweb_train_000002.bin from kjj0/fineweb10B-gpt2 is not a valid shard",
                          "bad magic number", "rerun")
    assert hub.body_gets["fineweb_train_000002.bin"] == 1
    assert listing(out) == ["fineweb_train_000001.bin", "fineweb_val_000000.bin"]


def test_a_missing_file_gives_one_line_and_no_file_while_the_others_finish(hub, tmp_path):
    del hub.files[(REPO, TRAIN2)]
    proc, out = run(hub, tmp_path, "3", "--workers=4")
    assert_one_line_error(
        proc, "error: could not download fineweb_train_000002.bin from kjj0/fineweb10B-gpt2 (404 Not Found); "
              "check N, --dataset and HF_ENDPOINT and rerun")
    assert_served(hub, out, [VAL, TRAIN1, TRAIN3])


def test_each_failed_file_gets_its_own_line(hub, tmp_path):
    del hub.files[(REPO, TRAIN1)]
    hub.files[(REPO, TRAIN3)] = hub.files[(REPO, TRAIN3)][:-2]
    proc, out = run(hub, tmp_path, "3", "--workers=4")
    assert proc.returncode == 1, proc.stderr
    errors = sorted(line for line in proc.stderr.splitlines() if line.startswith("error:"))
    assert len(errors) == 2, proc.stderr
    assert errors[0].startswith("error: could not download fineweb_train_000001.bin from kjj0/fineweb10B-gpt2 (404")
    assert errors[1].startswith("error: fineweb_train_000003.bin from kjj0/fineweb10B-gpt2 is not a valid shard")
    assert_served(hub, out, [VAL, TRAIN2])


def test_a_cut_transfer_leaves_no_partial_file_and_a_rerun_finishes(hub, tmp_path):
    hub.cut.add("fineweb_train_000001.bin")
    proc, out = run(hub, tmp_path, "2")
    assert_one_line_error(proc, "error: could not download fineweb_train_000001.bin from kjj0/fineweb10B-gpt2 (",
                          "check your connection and HF_ENDPOINT and rerun")
    assert hub.body_gets["fineweb_train_000001.bin"] > 1  # the client tried to resume
    assert_served(hub, out, [VAL, TRAIN2])  # nothing partial, staging removed

    hub.cut.clear()
    proc, _ = run(hub, tmp_path, "2")
    assert proc.returncode == 0, proc.stderr
    assert "2 of 3 shards already in" in proc.stdout
    assert hub.body_gets[VAL] == 1 and hub.body_gets[TRAIN2] == 1
    assert_served(hub, out, [VAL, TRAIN1, TRAIN2])


def test_other_datasets_use_their_repo_and_names(hub, tmp_path):
    hub.files[("kjj0/finewebedu10B-gpt2", "finewebedu_val_000000.bin")] = shard_bytes(tmp_path, 500, 10)
    hub.files[("kjj0/finewebedu10B-gpt2", "finewebedu_train_000001.bin")] = shard_bytes(tmp_path, 600, 11)
    proc, out = run(hub, tmp_path, "1", "--dataset", "finewebedu10B")
    assert proc.returncode == 0, proc.stderr
    assert listing(out) == ["finewebedu_train_000001.bin", "finewebedu_val_000000.bin"]


def test_bad_n_or_workers_is_refused_before_any_request(hub, tmp_path):
    proc, out = run(hub, tmp_path, "104")
    assert_one_line_error(proc, "error: N=104 is out of range: kjj0/fineweb10B-gpt2 has train shards 1 to 103")
    proc, out = run(hub, tmp_path, "100", "--dataset", "finewebedu10B")
    assert_one_line_error(proc, "kjj0/finewebedu10B-gpt2 has train shards 1 to 99")
    proc, out = run(hub, tmp_path, "2", "--workers=0")
    assert_one_line_error(
        proc, "error: --workers=0 is out of range: give the number of files to fetch at once, 1 or more")
    assert hub.requests == []
    assert not out.exists() or listing(out) == []


# A transfer waits for the others to open (3 s at most, under the client's 5 s read timeout),
# so transfers that run at the same time are seen to, however fast each one is.
@pytest.mark.parametrize("args, hold, overlap", [
    ((), (4, 3), 4),  # the default: all four files at once
    (("--workers=2",), (2, 3), 2),
    (("--workers=1",), (2, 0.3), 1),  # each transfer waits 0.3 s for a second one to start
])
def test_workers_transfer_files_at_the_same_time(hub, tmp_path, args, hold, overlap):
    hub.hold = hold
    proc, out = run(hub, tmp_path, "3", *args)
    assert proc.returncode == 0, proc.stderr
    assert hub.max_in_flight == overlap
    assert_served(hub, out, [VAL, TRAIN1, TRAIN2, TRAIN3])


def interrupt(proc, thread):
    """SIGINT to the process, or to its newest thread only: the kernel may hand a Ctrl-C to
    any thread that does not block it."""
    if not thread:
        proc.send_signal(signal.SIGINT)
        return
    tid = max(int(t) for t in os.listdir(f"/proc/{proc.pid}/task") if int(t) != proc.pid)
    if ctypes.CDLL(None, use_errno=True).tgkill(proc.pid, tid, signal.SIGINT) != 0:
        raise OSError(ctypes.get_errno(), f"tgkill({proc.pid}, {tid}) failed")


@pytest.mark.parametrize("workers, stalled, kept, thread", [
    (2, [TRAIN2, TRAIN3], [VAL, TRAIN1], False),  # both workers in the middle of a file
    (1, [VAL], [], False),  # one in the middle of a file, three queued
    (1, [VAL], [], True),  # the signal lands on a thread that is not the main one
])
def test_ctrl_c_during_transfers_leaves_no_partial_file_and_exits_at_once(
        hub, tmp_path, workers, stalled, kept, thread):
    hub.stall.update(stalled)
    proc, out = start(hub, tmp_path, "3", f"--workers={workers}")
    with proc:
        try:
            for _ in stalled:
                assert hub.stalled.acquire(timeout=30), "the downloader never got to the stalled files"
            for name in stalled:
                assert (out / ".download" / name).is_dir()  # its transfer is staged
            started = time.monotonic()
            interrupt(proc, thread)
            stdout, stderr = proc.communicate(timeout=20)
            # The stalled transfers stay open for 30 s: an exit that waited for them would show.
            assert time.monotonic() - started < 5
        finally:
            proc.kill()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == "error: interrupted; rerun to continue (finished shards are kept)"
    assert_served(hub, out, kept)  # no staging folder, nothing partial
    assert set(hub.body_gets) == set(kept) | set(stalled)  # queued files never started
