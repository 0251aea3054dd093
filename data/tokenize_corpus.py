"""Tokenize text documents with GPT-2 into speedrun shards.

    python data/tokenize_corpus.py INPUT... --out DIR --name PREFIX
        [--shard-tokens N] [--val-tokens N] [--seed S | --keep-order] [--workers K] [--force]

INPUT is a .txt file (one document), a .jsonl file (one document per line, in its "text"
field) or a folder searched recursively for both (sorted, so the order is reproducible).
Each document is prefixed with <|endoftext|>, like the speedrun's FineWeb shards.

The documents are shuffled, with --seed (default 0): the first --val-tokens tokens of the
shuffled order go to DIR/PREFIX_val_000000.bin, the rest to PREFIX_train_000001.bin,
PREFIX_train_000002.bin, ... of at most --shard-tokens tokens each, so validation is a random
sample of the documents and training reads them in random order. The shuffle is exact, over the
whole corpus: the tokens are kept in a hidden temporary file in DIR (2 bytes a token) and memory
holds one shard plus 16 bytes a document. --keep-order keeps the input order instead and writes
the shards as it tokenizes, without the temporary file. The same command gives the same shards.
Shards appear only when all of them are complete; existing shards with the same PREFIX are
replaced only with --force.
"""

import argparse
import array
import collections
import json
import os
import re
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

import shards
from gpt2_tokenizer import TokenizerError, get_gpt2_encoding
from pypi_sdist import FetchError

SHARD_TOKENS = 100_000_000  # as the FineWeb shards
# The speedrun validates on 10 * 2**20 tokens and reads one more, the last target.
VAL_TOKENS = 10 * 2**20 + 1
SUFFIXES = (".txt", ".jsonl")
BATCH_CHARS = 8 << 20  # characters handed to the encoder threads at a time


class CorpusError(ValueError):
    """Bad input documents or an output that would clobber existing shards."""


def find_input_files(inputs):
    """Expand files and folders into the list of .txt/.jsonl files, folders sorted recursively."""
    files = []
    for item in map(Path, inputs):
        if item.is_dir():
            found = sorted(p for p in item.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
            if not found:
                raise CorpusError(f"{item}: folder holds no .txt or .jsonl files")
            files.extend(found)
        elif item.is_file():
            if item.suffix not in SUFFIXES:
                raise CorpusError(f"{item}: unsupported input; give .txt or .jsonl files or folders of them")
            files.append(item)
        else:
            raise CorpusError(f"{item}: no such file or folder")
    return files


def read_documents(files):
    """Yield the documents of `files` in order: a .txt file whole, a .jsonl file line by line."""
    for path in files:
        try:
            if path.suffix == ".txt":
                yield path.read_text(encoding="utf-8")
            else:
                with open(path, encoding="utf-8") as f:
                    for number, line in enumerate(f, 1):
                        if line.strip():
                            yield _jsonl_text(path, number, line)
        except UnicodeDecodeError as e:
            raise CorpusError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from e


def _jsonl_text(path, number, line):
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise CorpusError(f"{path}:{number}: not a JSON line ({e.msg})") from e
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise CorpusError(f'{path}:{number}: no string "text" field on this line')
    return record["text"]


def tokenize_documents(docs, encoding, workers=1):
    """Yield one uint16 array per document, <|endoftext|> followed by its tokens, in order.

    Threads, not processes: tiktoken encodes without holding the GIL, so threads scale
    without pickling texts and tokens between processes (measured on 2 cores: 1.7x for
    threads, 0.9x for a process pool).
    """
    eot = encoding.eot_token
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for batch in _batches(docs):
            for tokens in pool.map(encoding.encode_ordinary, batch):
                out = np.empty(len(tokens) + 1, dtype=np.uint16)
                out[0] = eot
                out[1:] = tokens
                yield out


def _batches(docs):
    # Bounded batches keep memory flat however large the corpus is.
    batch, chars = [], 0
    for doc in docs:
        batch.append(doc)
        chars += len(doc)
        if chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


class TokenStream:
    """Token arrays joined into one stream that is consumed in slices of chosen sizes."""

    def __init__(self, arrays):
        self._arrays = iter(arrays)
        self._pending = collections.deque()
        self.arrays_read = 0

    def take(self, n):
        """The next `n` tokens, or fewer when the stream ends."""
        parts, have = [], 0
        while have < n:
            if not self._pending:
                nxt = next(self._arrays, None)
                if nxt is None:
                    break
                self.arrays_read += 1
                self._pending.append(nxt)
            head = self._pending.popleft()
            if have + head.size > n:
                cut = n - have
                self._pending.appendleft(head[cut:])
                head = head[:cut]
            parts.append(head)
            have += head.size
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.uint16)

    @property
    def mid_array(self):
        """Whether the last array read has been only partly taken."""
        return bool(self._pending)


class ShardSet:
    """The shards named PREFIX_<split>_NNNNNN.bin in one folder, replaced all at once.

    Shards are written under hidden temporary names and renamed when the `with` block ends
    without error; on error they are deleted, leaving the folder as it was. Existing shards
    of the prefix are an error unless `replace`, in which case those not rewritten are removed.
    """

    def __init__(self, out_dir, prefix, replace=False):
        self.out_dir = Path(out_dir)
        self.prefix = prefix
        pattern = re.compile(rf"{re.escape(prefix)}_(val|train)_\d{{6}}\.bin")
        self.existing = (
            sorted(p for p in self.out_dir.iterdir() if pattern.fullmatch(p.name)) if self.out_dir.is_dir() else []
        )
        if self.existing and not replace:
            raise CorpusError(
                f"{self.existing[0]} already exists ({len(self.existing)} shards named {prefix}_* in "
                f"{self.out_dir}); pass --force to replace them or choose another --name"
            )
        self.written = []  # (final path, token count), in writing order

    def write(self, split, index, tokens):
        final = self.out_dir / f"{self.prefix}_{split}_{index:06d}.bin"
        self.written.append((final, int(tokens.size)))
        shards.write_shard(self._partial(final), tokens)

    @staticmethod
    def _partial(final):
        return final.with_name(f".{final.name}.{os.getpid()}.partial")

    def __enter__(self):
        self.out_dir.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            for final, _ in self.written:
                os.replace(self._partial(final), final)
            kept = {final for final, _ in self.written}
            for old in self.existing:
                if old not in kept:
                    old.unlink()
        else:
            for final, _ in self.written:
                self._partial(final).unlink(missing_ok=True)
        return False


def write_split(shard_set, split, stream, shard_tokens, first_index, max_shards=None):
    """Write `stream` as shards of `split` numbered from `first_index`, each of at most
    `shard_tokens` tokens, stopping after `max_shards`; return the token count of each."""
    counts = []
    while max_shards is None or len(counts) < max_shards:
        tokens = stream.take(shard_tokens)
        if not tokens.size:
            break
        shard_set.write(split, first_index + len(counts), tokens)
        counts.append(int(tokens.size))
    return counts


class Summary(collections.namedtuple("Summary", "documents val_documents cut seed written")):
    """What tokenize_corpus made: `documents` in all, `val_documents` of them begin in the val
    shard, `cut` when the last of them ends in the first train shard (it counts in val), `seed`
    (None with keep_order) and `written`, [(shard path, tokens)] in writing order."""

    @property
    def train_documents(self):
        return self.documents - self.val_documents


def tokenize_corpus(inputs, out_dir, name, shard_tokens=SHARD_TOKENS, val_tokens=VAL_TOKENS,
                    workers=1, force=False, encoding=None, seed=None, keep_order=False):
    """Tokenize `inputs` into shards in `out_dir`, the documents shuffled with `seed` (default 0)
    unless `keep_order`; return a Summary."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise CorpusError(f"--name {name!r}: use letters, digits, '.', '_' and '-' only")
    if not 0 < shard_tokens <= shards.MAX_TOKENS or not 0 < val_tokens <= shards.MAX_TOKENS:
        raise CorpusError(f"--shard-tokens and --val-tokens must be between 1 and {shards.MAX_TOKENS}")
    if keep_order and seed is not None:
        raise CorpusError("--seed has no effect with --keep-order; pass one or the other")
    if seed is None and not keep_order:
        seed = 0
    if seed is not None and seed < 0:
        raise CorpusError(f"--seed {seed}: must be 0 or more")
    files = find_input_files(inputs)
    with ShardSet(out_dir, name, replace=force) as out:
        encoding = encoding or get_gpt2_encoding()
        arrays = tokenize_documents(read_documents(files), encoding, workers)
        if keep_order:
            stream = TokenStream(arrays)
            val_documents, cut = _write_splits(out, stream, shard_tokens, val_tokens, lambda: stream.arrays_read)
            documents = stream.arrays_read
        else:
            documents, val_documents, cut = _write_shuffled(out, arrays, shard_tokens, val_tokens, seed)
    return Summary(documents, val_documents, cut, seed, out.written)


def _write_splits(out, stream, shard_tokens, val_tokens, documents_read):
    """The val shard then the train shards from `stream`; returns (documents begun in val,
    whether the last of them goes on in train)."""
    val = write_split(out, "val", stream, val_tokens, 0, max_shards=1)
    val_documents, cut = stream.arrays_read, stream.mid_array
    if not write_split(out, "train", stream, shard_tokens, 1):
        raise CorpusError(
            f"the inputs hold only {sum(val)} tokens in {documents_read()} documents, all taken "
            f"by --val-tokens {val_tokens}; pass a smaller --val-tokens"
        )
    return val_documents, cut


def _write_shuffled(out, arrays, shard_tokens, val_tokens, seed):
    """Write the documents of `arrays` in the order of a seeded permutation; return
    (documents, documents begun in val, whether the last of them goes on in train).

    An exact shuffle, not a bounded buffer's approximate one: validation is then a uniform sample
    and a short run sees the whole corpus. The tokens wait on disk, in the output folder."""
    fd, spill = tempfile.mkstemp(dir=out.out_dir, prefix=f".{out.prefix}_documents.", suffix=".tmp")
    try:
        # ends[i + 1] is the token offset where document i ends: 8 bytes a document.
        ends = array.array("q", [0])
        with os.fdopen(fd, "wb") as f:
            for tokens in arrays:
                f.write(memoryview(tokens.astype("<u2", copy=False)))
                ends.append(ends[-1] + tokens.size)
        offsets = np.frombuffer(ends, dtype=np.int64)
        documents, total = offsets.size - 1, int(offsets[-1])
        if total <= val_tokens:
            raise CorpusError(
                f"the inputs hold only {total} tokens in {documents} documents, all taken "
                f"by --val-tokens {val_tokens}; pass a smaller --val-tokens"
            )
        order = np.random.default_rng(seed).permutation(documents)  # another 8 bytes a document
        tokens = np.memmap(spill, dtype="<u2", mode="r")
        stream = TokenStream(tokens[offsets[i]:offsets[i + 1]] for i in order)
        val_documents, cut = _write_splits(out, stream, shard_tokens, val_tokens, lambda: documents)
        del stream, tokens  # closes the map before the file goes
        return documents, val_documents, cut
    finally:
        os.unlink(spill)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="The shuffle is exact, over all documents: their tokens wait in a hidden temporary file in --out "
               "(2 bytes a token, deleted at the end) and memory holds one shard plus 16 bytes a document. "
               "See data/README.md.")
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help=".txt/.jsonl files or folders of them")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--name", required=True, help="shard name prefix, e.g. mycorpus")
    parser.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS, help="tokens per train shard")
    parser.add_argument("--val-tokens", type=int, default=VAL_TOKENS,
                        help=f"tokens in the val shard (default {VAL_TOKENS:,}: train_gpt.py reads --val_tokens + 1)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the document shuffle (default 0); the same seed gives the same shards")
    parser.add_argument("--keep-order", action="store_true",
                        help="keep the input order: the first --val-tokens tokens are validation, "
                             "no shuffle and no temporary file")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="encoder threads")
    parser.add_argument("--force", action="store_true", help="replace existing shards of this name")
    args = parser.parse_args(argv)
    try:
        summary = tokenize_corpus(args.inputs, args.out, args.name, args.shard_tokens, args.val_tokens,
                                  args.workers, args.force, seed=args.seed, keep_order=args.keep_order)
    except (CorpusError, TokenizerError, FetchError, shards.ShardError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    order = "in input order (--keep-order)" if summary.seed is None else f"shuffled with seed {summary.seed}"
    print(f"{summary.documents:,} documents {order}: {summary.val_documents:,} to validation, "
          f"{summary.train_documents:,} to training" + ("; the one cut between them counts in validation"
                                                         if summary.cut else ""))
    for path, count in summary.written:
        print(f"{path}: {count:,} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
