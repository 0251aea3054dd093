"""Download pre-tokenized FineWeb GPT-2 shards from the Hugging Face hub.

    python data/cached_fineweb10B.py [N] [--dataset fineweb10B|finewebedu10B|fineweb100B] [--out DIR]
                                     [--workers W]

Fetches the validation shard and the first N training shards (default 8, the record run's
need; each holds 100M tokens, about 200 MB) into data/<dataset>/, W files at a time (default
4). Files already there with a valid header are kept. Each file is downloaded into its own
folder under DIR/.download/ and moved to its final name only once its header checks out, so a
final name never holds a partial file. A file that fails gets one error line and the others
still finish; the exit status is then 1 and a rerun fetches only what is missing. The run
removes DIR/.download/ when it ends, on Ctrl-C too, so do not run two downloads into one
folder at once. HF_ENDPOINT, HF_TOKEN and the other huggingface_hub settings apply as usual.
"""

import argparse
import os
import shutil
import sys
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import huggingface_hub
from huggingface_hub.errors import HfHubHTTPError

import shards

DATA_DIR = Path(__file__).resolve().parent
DEFAULT_SHARDS = 8
DEFAULT_WORKERS = 4  # files at once: a few connections fill a typical link without hammering the hub
STAGING = ".download"


@dataclass(frozen=True)
class Dataset:
    repo_id: str
    prefix: str
    train_shards: int


# The kjj0 repos and their file names, as modded-nanogpt's download scripts use them.
DATASETS = {
    "fineweb10B": Dataset("kjj0/fineweb10B-gpt2", "fineweb", 103),
    "finewebedu10B": Dataset("kjj0/finewebedu10B-gpt2", "finewebedu", 99),
    "fineweb100B": Dataset("kjj0/fineweb100B-gpt2", "fineweb", 1030),
}


class DownloadError(RuntimeError):
    """A shard could not be downloaded or is not a valid shard."""


def shard_names(dataset, n):
    return [f"{dataset.prefix}_val_000000.bin"] + [f"{dataset.prefix}_train_{i:06d}.bin" for i in range(1, n + 1)]


def _explain(error):
    """(reason, what to check) for a failed download: the HTTP status, else the innermost exception."""
    response = getattr(error, "response", None)
    if isinstance(error, HfHubHTTPError) and response is not None:
        status = response.status_code
        hint = {404: "N, --dataset and HF_ENDPOINT", 401: "HF_TOKEN and HF_ENDPOINT", 403: "HF_TOKEN and HF_ENDPOINT"}
        return f"{status} {response.reason_phrase}".strip(), hint.get(status, "HF_ENDPOINT")
    while error.__cause__ is not None:
        error = error.__cause__
    lines = str(error).strip().splitlines()
    reason = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return reason, "your connection and HF_ENDPOINT"


def _download(dataset, name, out_dir, staging):
    """Fetch `name` into the folder `staging`, check its header and move it into `out_dir`;
    return its token count."""
    try:
        staged = Path(huggingface_hub.hf_hub_download(
            repo_id=dataset.repo_id, filename=name, repo_type="dataset", local_dir=staging))
    except Exception as e:  # whatever the hub client raises, the user gets one line and a retry hint
        reason, check = _explain(e)
        raise DownloadError(
            f"could not download {name} from {dataset.repo_id} ({reason}); check {check} and rerun"
        ) from e
    try:
        count = shards.read_header(staged)
    except shards.ShardError as e:
        staged.unlink()
        reason = str(e).removeprefix(f"{staged}: ")
        raise DownloadError(
            f"{name} from {dataset.repo_id} is not a valid shard ({reason}); it was deleted, rerun to try again"
        ) from e
    os.replace(staged, out_dir / name)
    return count


def download(dataset, n, out_dir, workers=DEFAULT_WORKERS):
    """Make sure `out_dir` holds the val shard and train shards 1..n of `dataset`, fetching
    `workers` files at once. Prints one error line per file that fails; returns how many failed."""
    if not 0 <= n <= dataset.train_shards:
        raise DownloadError(
            f"N={n} is out of range: {dataset.repo_id} has train shards 1 to {dataset.train_shards}"
        )
    if workers < 1:
        raise DownloadError(
            f"--workers={workers} is out of range: give the number of files to fetch at once, 1 or more"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    names = shard_names(dataset, n)
    missing = []
    for name in names:
        path = out_dir / name
        if not path.exists():
            missing.append(name)
            continue
        try:
            shards.read_header(path)
        except shards.ShardError as e:
            print(f"{e}; downloading it again", flush=True)
            missing.append(name)
    print(f"{len(names) - len(missing)} of {len(names)} shards already in {out_dir}", flush=True)
    if not missing:
        return 0
    staging = out_dir / STAGING
    # A run that was killed can leave a partial download behind; it is of no use now.
    shutil.rmtree(staging, ignore_errors=True)
    print(f"downloading {len(missing)} shards from {dataset.repo_id}, {workers} at a time", flush=True)
    pool = ThreadPoolExecutor(max_workers=workers)
    failed = 0
    try:
        # Each file gets its own staging folder: concurrent transfers share no temporary path.
        futures = {pool.submit(_download, dataset, name, out_dir, staging / name): name for name in missing}
        pending, finished = set(futures), 0
        while pending:
            # Wait in short steps: the kernel may hand Ctrl-C to a worker thread, and Python raises
            # KeyboardInterrupt only once the main thread runs again.
            done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            for future in done:
                finished += 1
                try:
                    count = future.result()
                except (DownloadError, OSError) as e:
                    failed += 1
                    print(f"error: {e}", file=sys.stderr, flush=True)
                else:
                    path = out_dir / futures[future]
                    print(f"[{finished}/{len(missing)}] {path}: {count:,} tokens", flush=True)
    finally:
        # Normally every file is done by now. After Ctrl-C, queued files never start, and what the
        # transfers still in flight have written goes with the staging folder.
        pool.shutdown(wait=False, cancel_futures=True)
        shutil.rmtree(staging, ignore_errors=True)
    return failed


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("n", nargs="?", type=int, default=DEFAULT_SHARDS, metavar="N",
                        help=f"number of train shards (default {DEFAULT_SHARDS})")
    parser.add_argument("--dataset", choices=sorted(DATASETS), default="fineweb10B")
    parser.add_argument("--out", type=Path, help="target folder (default data/<dataset>)")
    parser.add_argument("--workers", type=int, default=DEFAULT_WORKERS, metavar="W",
                        help=f"files to download at once (default {DEFAULT_WORKERS})")
    args = parser.parse_args(argv)
    out_dir = args.out or DATA_DIR / args.dataset
    try:
        failed = download(DATASETS[args.dataset], args.n, out_dir, args.workers)
    except (DownloadError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted; rerun to continue (finished shards are kept)", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        # Worker threads blocked in a transfer cannot be interrupted, and a normal exit joins the
        # pool's threads, so it would wait for every transfer to end. What they write was staged
        # in a folder that is already removed, so end the process now.
        os._exit(130)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
