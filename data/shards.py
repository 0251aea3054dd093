"""The speedrun's token shard format (from llm.c).

A shard is a header of HEADER_INTS little-endian int32 values, [0] = MAGIC, [1] = VERSION,
[2] = number of tokens, the rest zero, followed by that many little-endian uint16 tokens.
"""

from pathlib import Path

import numpy as np

from atomic_file import atomic_write

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
MAX_TOKENS = 2**31 - 1  # the count is an int32
TOKEN_MAX = 2**16 - 1  # tokens are uint16


class ShardError(ValueError):
    """A shard file is malformed, or tokens cannot be stored as one."""


def write_shard(path, tokens):
    """Write `tokens` (any sequence or array of ints in [0, 65535]) as a shard at `path`.

    The file appears under its name only once complete; an existing file is left untouched
    when anything fails.
    """
    path = Path(path)
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ShardError(f"{path}: tokens must be a flat sequence, got shape {tokens.shape}")
    if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
        raise ShardError(f"{path}: tokens must be integers, got dtype {tokens.dtype}")
    if tokens.size > MAX_TOKENS:
        raise ShardError(f"{path}: {tokens.size} tokens do not fit one shard (at most {MAX_TOKENS})")
    bad = np.flatnonzero((tokens < 0) | (tokens > TOKEN_MAX))
    if bad.size:
        i = int(bad[0])
        raise ShardError(
            f"{path}: token {int(tokens[i])} at position {i} is outside [0, {TOKEN_MAX}]; "
            "a shard stores uint16 tokens"
        )
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (MAGIC, VERSION, tokens.size)
    with atomic_write(path) as f:
        header.tofile(f)
        tokens.astype("<u2", copy=False).tofile(f)


def read_header(path):
    """Validate the header of the shard at `path` against its size; return its token count."""
    path = Path(path)
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise ShardError(
            f"{path}: {size} bytes is shorter than the {HEADER_BYTES}-byte shard header; "
            "the file is truncated or not a shard"
        )
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(HEADER_BYTES), dtype="<i4")
    if header[0] != MAGIC:
        raise ShardError(f"{path}: bad magic number {header[0]} (expected {MAGIC}); not a token shard")
    if header[1] != VERSION:
        raise ShardError(f"{path}: unsupported shard version {header[1]} (expected {VERSION})")
    count = int(header[2])
    expected = HEADER_BYTES + 2 * count
    if count < 0 or size < expected:
        raise ShardError(
            f"{path}: header declares {count} tokens ({expected} bytes) but the file has only "
            f"{size} bytes; it is truncated: delete it and recreate or download it again"
        )
    if size > expected:
        raise ShardError(
            f"{path}: file has {size} bytes, {size - expected} more than the {count} tokens its "
            f"header declares ({expected} bytes); it is corrupt: delete it and recreate it"
        )
    return count


def read_shard(path, vocab_size=None):
    """Return the tokens of the shard at `path` as a uint16 array, after validating it.

    With `vocab_size`, every token must also be below it.
    """
    count = read_header(path)
    tokens = np.fromfile(path, dtype="<u2", count=count, offset=HEADER_BYTES).astype(np.uint16, copy=False)
    if vocab_size is not None:
        bad = np.flatnonzero(tokens >= vocab_size)
        if bad.size:
            i = int(bad[0])
            raise ShardError(
                f"{path}: token {int(tokens[i])} at position {i} is not below vocab_size {vocab_size}; "
                "the shard was made with a different tokenizer"
            )
    return tokens
