import struct

import numpy as np
import pytest

import atomic_file
import shards
import train_gpt


def raw_shard(tokens, magic=20240520, version=1, count=None):
    """Shard bytes built by hand from the llm.c layout, independent of shards.write_shard."""
    header = struct.pack("<3i", magic, version, len(tokens) if count is None else count) + bytes(253 * 4)
    return header + struct.pack(f"<{len(tokens)}H", *tokens)


def test_round_trip_matches_the_llmc_layout(tmp_path):
    tokens = [0, 1, 50256, 65535, 7]
    path = tmp_path / "a.bin"
    shards.write_shard(path, tokens)
    assert path.read_bytes() == raw_shard(tokens)
    got = shards.read_shard(path)
    assert got.dtype == np.uint16
    assert got.tolist() == tokens
    assert shards.read_header(path) == 5


def test_round_trip_of_an_array_and_of_no_tokens(tmp_path):
    tokens = np.arange(3000, dtype=np.int64) * 17 % 50257
    shards.write_shard(tmp_path / "a.bin", tokens)
    assert np.array_equal(shards.read_shard(tmp_path / "a.bin", vocab_size=50257), tokens)
    shards.write_shard(tmp_path / "empty.bin", [])
    assert shards.read_shard(tmp_path / "empty.bin").size == 0
    assert (tmp_path / "empty.bin").stat().st_size == 1024


TRUNCATED = "the file is truncated or corrupt"


@pytest.mark.parametrize(
    "data, message, train_gpt_message",
    [
        (b"\x00" * 1000, "1000 bytes is shorter than the 1024-byte shard header",
         "1000 bytes is shorter than the 1024-byte shard header"),
        (raw_shard([1, 2], magic=12345), "bad magic number 12345 (expected 20240520)",
         "bad magic 12345 (expected 20240520); not a token shard"),
        (raw_shard([1, 2], version=2), "unsupported shard version 2 (expected 1)",
         "unsupported shard version 2 (expected 1)"),
        (raw_shard([1, 2], count=3), "header declares 3 tokens (1030 bytes) but the file has only 1028 bytes",
         f"header says 3 tokens (1030 bytes with the header) but the file has 1028 bytes; {TRUNCATED}"),
        (raw_shard([1, 2], count=1), "file has 1028 bytes, 2 more than the 1 tokens its header declares",
         f"header says 1 tokens (1026 bytes with the header) but the file has 1028 bytes; {TRUNCATED}"),
        (raw_shard([1, 2], count=-1), "header declares -1 tokens",
         f"header says -1 tokens (1022 bytes with the header) but the file has 1028 bytes; {TRUNCATED}"),
    ],
    ids=["short", "magic", "version", "count-too-large", "count-too-small", "count-negative"],
)
def test_corrupt_shards_are_rejected_with_their_reason(tmp_path, data, message, train_gpt_message):
    """By data/shards.py and by train_gpt.py's own reader (the record path imports nothing from data/)."""
    path = tmp_path / "bad.bin"
    path.write_bytes(data)
    for read in (shards.read_header, shards.read_shard):
        with pytest.raises(shards.ShardError) as err:
            read(path)
        assert message in str(err.value)
        assert str(err.value).startswith(f"{path}: ")
    with pytest.raises(train_gpt.DataError) as err:
        train_gpt.load_shard(path, 50257)
    assert str(err.value) == f"{path}: {train_gpt_message}"


def test_tokens_outside_the_vocabulary_are_named(tmp_path):
    path = tmp_path / "v.bin"
    path.write_bytes(raw_shard([5, 50256, 50257, 60000]))
    assert shards.read_shard(path).tolist() == [5, 50256, 50257, 60000]
    with pytest.raises(shards.ShardError) as err:
        shards.read_shard(path, vocab_size=50257)
    assert str(err.value).startswith(f"{path}: token 50257 at position 2 is not below vocab_size 50257")


@pytest.mark.parametrize(
    "tokens, message",
    [
        ([1, 2, 65536], "token 65536 at position 2 is outside [0, 65535]"),
        ([3, -1], "token -1 at position 1 is outside [0, 65535]"),
        ([1.5, 2.0], "tokens must be integers"),
        ([[1, 2]], "tokens must be a flat sequence"),
    ],
)
def test_a_failed_write_leaves_the_existing_file_and_no_temporary(tmp_path, tokens, message):
    path = tmp_path / "keep.bin"
    shards.write_shard(path, [9, 9, 9])
    before = path.read_bytes()
    with pytest.raises(shards.ShardError) as err:
        shards.write_shard(path, tokens)
    assert message in str(err.value) and str(path) in str(err.value)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.bin"]


def test_an_error_midway_through_a_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "x.bin"
    shards.write_shard(path, [4])
    with pytest.raises(OSError, match="disk full"):
        with atomic_file.atomic_write(path) as f:
            f.write(b"partial")
            raise OSError("disk full")
    assert shards.read_shard(path).tolist() == [4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.bin"]
