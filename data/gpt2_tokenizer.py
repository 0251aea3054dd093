"""The GPT-2 tokenizer as a tiktoken Encoding, also without access to tiktoken's download host.

tiktoken.get_encoding("gpt2") downloads vocab.bpe and encoder.json from an OpenAI blob store.
When that fails, the identical encoding is built from the GPT-2 BPE ranks in tiktoken's own
format (`gpt2.tiktoken`, the same bytes as tiktoken's r50k_base ranks), taken from, in order:
the `ranks_path` argument, the GPT2_TIKTOKEN_FILE environment variable, the cache
data/cache/gpt2.tiktoken, or else the openai-whisper source distribution on the package index
(MIT licensed; it ships the file as whisper/assets/gpt2.tiktoken), which is then cached.
"""

import base64
import hashlib
import os
import sys
import tempfile
import threading
from pathlib import Path

import tiktoken

from atomic_file import atomic_write
from pypi_sdist import CACHE_DIR, FetchError, download_sdist, read_member

RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
RANKS_FILENAME = "gpt2.tiktoken"
WHISPER_REQUIREMENT = "openai-whisper==20250625"
WHISPER_MEMBER = "/whisper/assets/gpt2.tiktoken"
ENV_VAR = "GPT2_TIKTOKEN_FILE"
# The split pattern tiktoken uses for gpt2 and r50k_base (tiktoken_ext/openai_public.py).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
ENDOFTEXT = "<|endoftext|>"
EOT_TOKEN = 50256
N_VOCAB = 50257
# tiktoken's download uses requests without a timeout; a network that drops packets instead
# of refusing them would stall it for minutes, so the attempt is abandoned after this long.
ONLINE_TIMEOUT_S = 20


class TokenizerError(RuntimeError):
    """The GPT-2 ranks could not be found, fetched, or did not match the pinned sha256."""


def get_gpt2_encoding(ranks_path=None, cache_dir=CACHE_DIR):
    """Return the GPT-2 tiktoken Encoding (n_vocab 50257, <|endoftext|> = 50256): tiktoken's
    own when it loads, else the same encoding built from the ranks file (see the module doc)."""
    encoding = _tiktoken_gpt2()
    if encoding is not None:
        return encoding
    ranks = _parse_ranks(_ranks_bytes(ranks_path, Path(cache_dir)))
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=GPT2_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={ENDOFTEXT: EOT_TOKEN},
        explicit_n_vocab=N_VOCAB,
    )


def cache_ranks(cache_dir=CACHE_DIR):
    """The ranks file in cache_dir, fetched from the package index if it is not there yet (./run.sh test: the tests
    that tokenize then run without the network). Raises TokenizerError when it cannot be had."""
    _ranks_bytes(None, Path(cache_dir))
    return Path(cache_dir) / RANKS_FILENAME


def _tiktoken_gpt2():
    """tiktoken's own gpt2 encoding, or None when it cannot be had (offline, blocked, slow)."""
    result = []

    def attempt():
        try:
            result.append(tiktoken.get_encoding("gpt2"))
        except Exception:  # any failure (network, hash, missing blobfile) means: build it ourselves
            pass

    # A daemon thread: if it stalls, the process can still exit once the fallback is done.
    worker = threading.Thread(target=attempt, name="tiktoken-gpt2", daemon=True)
    worker.start()
    worker.join(ONLINE_TIMEOUT_S)
    return result[0] if result else None


def _ranks_bytes(ranks_path, cache_dir):
    explicit = ranks_path or os.environ.get(ENV_VAR)
    if explicit:
        source = f"{ENV_VAR}={explicit}" if not ranks_path else str(explicit)
        try:
            data = Path(explicit).read_bytes()
        except OSError as e:
            raise TokenizerError(f"cannot read GPT-2 ranks file {source}: {e.strerror}") from e
        _check(data, explicit, "use an unmodified gpt2.tiktoken")
        return data
    cached = cache_dir / RANKS_FILENAME
    if cached.exists():
        data = cached.read_bytes()
        _check(data, cached, "delete it and rerun to fetch it again")
        return data
    return _fetch_ranks(cached)


def _fetch_ranks(cached):
    try:
        with tempfile.TemporaryDirectory(prefix="gpt2-ranks-") as tmp:
            data = read_member(download_sdist(WHISPER_REQUIREMENT, tmp), WHISPER_MEMBER)
    except FetchError as e:
        raise TokenizerError(
            f"no GPT-2 ranks: tiktoken could not download its gpt2 files and {e}; "
            f"or set {ENV_VAR} to a copy of gpt2.tiktoken"
        ) from e
    _check(data, f"{WHISPER_REQUIREMENT}:{WHISPER_MEMBER.lstrip('/')}", "the package index served other content")
    cached.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(cached) as f:
        f.write(data)
    print(f"cached the GPT-2 ranks in {cached}", file=sys.stderr)
    return data


def _check(data, name, hint):
    actual = hashlib.sha256(data).hexdigest()
    if actual != RANKS_SHA256:
        raise TokenizerError(
            f"{name}: sha256 {actual} is not that of the GPT-2 ranks ({RANKS_SHA256}); {hint}"
        )


def _parse_ranks(data):
    # tiktoken's format: one "<base64 token bytes> <rank>" pair per line.
    ranks = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


if __name__ == "__main__":  # python data/gpt2_tokenizer.py: the ranks into data/cache, where train_gpt.py reads them
    os.environ.pop(ENV_VAR, None)
    try:
        print(cache_ranks())
    except TokenizerError as e:
        sys.exit(f"error: {e}")
