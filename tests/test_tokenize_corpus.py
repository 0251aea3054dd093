import collections
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tiktoken

import gpt2_tokenizer
import shards
import tokenize_corpus as tc

# A byte-level encoding: token = byte value, <|endoftext|> = 256. Counts and contents can then
# be checked against the UTF-8 bytes of the inputs, independently of any BPE.
BYTES_ARGS = dict(name="bytes", pat_str=r"[\s\S]+", mergeable_ranks={bytes([i]): i for i in range(256)},
                  special_tokens={"<|endoftext|>": 256})
BYTES = tiktoken.Encoding(**BYTES_ARGS)


def write_inputs(root):
    """Inputs of each kind; returns (the INPUT arguments, the documents in the order expected)."""
    (root / "folder" / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("First document.\nTwo lines, ünïcode ✓", encoding="utf-8")
    (root / "b.jsonl").write_text(
        json.dumps({"text": "jsonl one", "id": 1}) + "\n\n"
        + json.dumps({"text": "jsonl two has <|endoftext|> inside as plain text"}) + "\n",
        encoding="utf-8",
    )
    (root / "folder" / "z.txt").write_text("z last", encoding="utf-8")
    (root / "folder" / "sub" / "m.jsonl").write_text(json.dumps({"text": "m in sub"}) + "\n", encoding="utf-8")
    (root / "folder" / "sub" / "a.txt").write_text("", encoding="utf-8")
    (root / "folder" / "notes.md").write_text("not an input", encoding="utf-8")
    inputs = [root / "a.txt", root / "b.jsonl", root / "folder"]
    docs = [
        "First document.\nTwo lines, ünïcode ✓",
        "jsonl one",
        "jsonl two has <|endoftext|> inside as plain text",
        "",  # folder/sub/a.txt
        "m in sub",  # folder/sub/m.jsonl
        "z last",  # folder/z.txt
    ]
    return inputs, docs


def read_all(out, name):
    """{file name: tokens} of every shard of `name` in `out`."""
    return {p.name: shards.read_shard(p) for p in sorted(out.glob(f"{name}_*.bin"))}


def split_documents(tokens, eot, decode):
    """Documents of a token stream in which every document starts with `eot`."""
    assert tokens[0] == eot
    starts = np.flatnonzero(tokens == eot).tolist() + [len(tokens)]
    return [decode(tokens[a + 1:b].tolist()) for a, b in zip(starts, starts[1:])]


def decode_bytes(tokens):
    return bytes(tokens).decode("utf-8")


def shard_stream(out, name):
    """The tokens of the val shard then the train shards, in the order a reader sees them."""
    found = read_all(out, name)
    return np.concatenate([found[f"{name}_val_000000.bin"]] + [found[f"{name}_train_{i:06d}.bin"]
                                                                for i in range(1, len(found))])


@pytest.mark.parametrize("keep_order", [True, False])
def test_inputs_become_documents_cut_into_shards(tmp_path, keep_order):
    inputs, docs = write_inputs(tmp_path)
    out = tmp_path / "out"
    summary = tc.tokenize_corpus(inputs, out, "t", shard_tokens=40, val_tokens=30, encoding=BYTES,
                                 keep_order=keep_order)
    written = summary.written
    total = sum(len(d.encode("utf-8")) + 1 for d in docs)
    train_total = total - 30
    n_train = -(-train_total // 40)
    expected_names = ["t_val_000000.bin"] + [f"t_train_{i:06d}.bin" for i in range(1, n_train + 1)]
    found = read_all(out, "t")
    assert summary.documents == len(docs)
    assert summary.seed == (None if keep_order else 0)
    assert sorted(found) == sorted(expected_names)
    assert [(p.name, n) for p, n in written] == [(n, found[n].size) for n in expected_names]
    assert [found[n].size for n in expected_names] == [30] + [40] * (n_train - 1) + [train_total - 40 * (n_train - 1)]
    stream = np.concatenate([found[n] for n in expected_names])
    got = split_documents(stream, 256, decode_bytes)
    if keep_order:
        assert got == docs  # the order before the shuffle existed
    else:
        assert sorted(got) == sorted(docs) and got != docs
    # A document cut between val and train counts in val.
    val_starts = int(np.count_nonzero(found["t_val_000000.bin"] == 256))
    assert (summary.val_documents, summary.train_documents) == (val_starts, len(docs) - val_starts)
    assert summary.cut == (found["t_train_000001.bin"][0] != 256)
    assert sorted(p.name for p in out.iterdir()) == sorted(expected_names)  # no temporaries left


def test_threads_and_batches_keep_the_order(monkeypatch):
    docs = [f"document number {i} " * (i % 7) for i in range(200)]
    monkeypatch.setattr(tc, "BATCH_CHARS", 100)
    one = [a.tolist() for a in tc.tokenize_documents(docs, BYTES, workers=1)]
    four = [a.tolist() for a in tc.tokenize_documents(docs, BYTES, workers=4)]
    assert one == four == [[256] + list(d.encode()) for d in docs]


def test_token_stream_cuts_across_arrays():
    stream = tc.TokenStream(np.arange(a, b, dtype=np.uint16) for a, b in [(0, 3), (3, 4), (4, 10)])
    assert [stream.take(4).tolist(), stream.take(5).tolist(), stream.take(5).tolist(), stream.take(5).size] == [
        [0, 1, 2, 3], [4, 5, 6, 7, 8], [9], 0
    ]


@pytest.mark.parametrize(
    "line, reason",
    [("{not json", "not a JSON line"), ('{"txt": "x"}', 'no string "text" field'), ('["a"]', 'no string "text"')],
)
def test_a_bad_jsonl_line_is_named_and_nothing_is_written(tmp_path, line, reason):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n\n' + line + "\n", encoding="utf-8")
    out = tmp_path / "out"
    with pytest.raises(tc.CorpusError) as err:
        tc.tokenize_corpus([bad], out, "t", shard_tokens=2, val_tokens=2, encoding=BYTES)
    assert str(err.value).startswith(f"{bad}:3: {reason}")
    assert list(out.iterdir()) == []


def test_too_few_tokens_for_training_is_an_error(tmp_path):
    (tmp_path / "a.txt").write_text("tiny", encoding="utf-8")
    with pytest.raises(tc.CorpusError, match="only 5 tokens in 1 documents, all taken by --val-tokens 100"):
        tc.tokenize_corpus([tmp_path / "a.txt"], tmp_path / "out", "t", val_tokens=100, encoding=BYTES)
    assert list((tmp_path / "out").iterdir()) == []


def test_bad_inputs_are_named(tmp_path):
    (tmp_path / "x.csv").write_text("a,b", encoding="utf-8")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    (tmp_path / "empty").mkdir()
    for path, message in [
        (tmp_path / "missing.txt", "no such file or folder"),
        (tmp_path / "x.csv", "unsupported input"),
        (tmp_path / "empty", "folder holds no .txt or .jsonl files"),
        (tmp_path / "latin1.txt", "not UTF-8 text"),
    ]:
        with pytest.raises(tc.CorpusError, match=message) as err:
            tc.tokenize_corpus([path], tmp_path / "out", "t", encoding=BYTES)
        assert str(err.value).startswith(str(path))


@pytest.mark.parametrize("kwargs, message", [
    ({"name": "../escape"}, "--name '../escape': use letters"),
    ({"shard_tokens": 0}, "--shard-tokens and --val-tokens must be between 1 and 2147483647"),
    ({"val_tokens": 2**31}, "--shard-tokens and --val-tokens must be between 1 and 2147483647"),
    ({"seed": 1, "keep_order": True}, "--seed has no effect with --keep-order"),
    ({"seed": -1}, "--seed -1: must be 0 or more"),
])
def test_bad_settings_are_refused(tmp_path, kwargs, message):
    (tmp_path / "a.txt").write_text("text", encoding="utf-8")
    with pytest.raises(tc.CorpusError, match=re.escape(message)):
        tc.tokenize_corpus([tmp_path / "a.txt"], tmp_path / "out", **{"name": "t", **kwargs}, encoding=BYTES)
    assert not (tmp_path / "out").exists()


def test_refuses_to_overwrite_unless_forced(tmp_path):
    inputs, _ = write_inputs(tmp_path)
    out = tmp_path / "out"
    tc.tokenize_corpus(inputs, out, "t", shard_tokens=20, val_tokens=10, encoding=BYTES)
    before = {name: t.tolist() for name, t in read_all(out, "t").items()}
    assert len(before) > 3
    with pytest.raises(tc.CorpusError, match=r"t_train_000001.bin already exists .* pass --force"):
        tc.tokenize_corpus(inputs[:1], out, "t", shard_tokens=20, val_tokens=10, encoding=BYTES)
    assert {name: t.tolist() for name, t in read_all(out, "t").items()} == before
    # A forced, smaller rebuild replaces the set: stale train shards of the old one go away.
    tc.tokenize_corpus(inputs[:1], out, "t", shard_tokens=20, val_tokens=10, force=True, encoding=BYTES)
    after = read_all(out, "t")
    assert sorted(after) == ["t_train_000001.bin", "t_train_000002.bin", "t_val_000000.bin"]
    assert after["t_val_000000.bin"].tolist() == [256] + list(b"First doc")


def test_command_line_with_gpt2(tmp_path, capsys, monkeypatch, no_tiktoken_download, gpt2_ranks_file):
    monkeypatch.setenv("GPT2_TIKTOKEN_FILE", str(gpt2_ranks_file))
    inputs, docs = write_inputs(tmp_path)
    out = tmp_path / "out"
    argv = [*map(str, inputs), "--out", str(out), "--name", "c", "--shard-tokens", "16", "--val-tokens", "8",
            "--keep-order"]
    assert tc.main(argv + ["--workers", "2"]) == 0
    printed = capsys.readouterr().out
    assert "6 documents in input order (--keep-order): 1 to validation, 5 to training" in printed
    assert f"{out / 'c_val_000000.bin'}: 8 tokens" in printed
    stream = shard_stream(out, "c")
    assert split_documents(stream, 50256, gpt2_tokenizer.get_gpt2_encoding().decode) == docs
    assert stream.tolist()[:5] == [50256, 5962, 3188, 13, 198]  # "First document.\n" in GPT-2 ids
    assert tc.main(argv) == 1
    assert capsys.readouterr().err.startswith(f"error: {out / 'c_train_000001.bin'} already exists")


def two_topic_folder(root, per_topic=30):
    """As in issue 29: documents on one topic, then on another, their names sorting by topic."""
    folder = root / "two_topics"
    folder.mkdir()
    for t, (topic, words) in enumerate([("astronomy", "telescope galaxy orbit comet"),
                                        ("cooking", "oven recipe garlic butter")]):
        for i in range(per_topic):
            text = " ".join(f"In {topic}, the {w} matters ({i})." for w in words.split())
            (folder / f"{t}_{topic}_{i:02d}.txt").write_text(text, encoding="utf-8")
    return folder


def topic_mentions(tokens):
    text = decode_bytes(tokens[tokens != 256].tolist())
    return text.count("astronomy"), text.count("cooking")


def test_two_topics_reach_both_validation_and_the_start_of_training(tmp_path):
    folder = two_topic_folder(tmp_path)
    mentions = {}
    for keep_order in (False, True):
        out = tmp_path / f"keep_order_{keep_order}"
        summary = tc.tokenize_corpus([folder], out, "c", val_tokens=1500, encoding=BYTES, keep_order=keep_order)
        found = read_all(out, "c")
        assert summary.documents == 60 and sorted(found) == ["c_train_000001.bin", "c_val_000000.bin"]
        train = found["c_train_000001.bin"]
        mentions[keep_order] = topic_mentions(found["c_val_000000.bin"]), topic_mentions(train[:train.size // 10])
    assert all(n > 0 for split in mentions[False] for n in split), mentions
    # The input order puts only the first topic in both: what the shuffle is for.
    assert [cooking for _, cooking in mentions[True]] == [0, 0], mentions


def test_the_same_command_gives_the_same_shards_whatever_the_workers(tmp_path, monkeypatch):
    folder = two_topic_folder(tmp_path)
    monkeypatch.setattr(tc, "BATCH_CHARS", 500)  # several encoder batches, each threads' work
    contents = {}
    for run, (workers, seed) in enumerate([(1, None), (3, 0), (1, 1)]):
        out = tmp_path / f"run{run}"
        tc.tokenize_corpus([folder], out, "c", shard_tokens=2000, val_tokens=1000, workers=workers,
                           encoding=BYTES, seed=seed)
        contents[run] = {p.name: p.read_bytes() for p in sorted(out.iterdir())}
    # Once more in a new process, as a second command would be.
    script = (f"import sys; sys.path.insert(0, {str(Path(tc.__file__).parent)!r}); "
              "import tiktoken, tokenize_corpus as tc; "
              f"tc.tokenize_corpus([{str(folder)!r}], {str(tmp_path / 'run3')!r}, 'c', shard_tokens=2000, "
              f"val_tokens=1000, encoding=tiktoken.Encoding(**{BYTES_ARGS!r}))")
    subprocess.run([sys.executable, "-c", script], check=True)
    contents[3] = {p.name: p.read_bytes() for p in sorted((tmp_path / "run3").iterdir())}
    assert len(contents[0]) > 3
    assert contents[0] == contents[1] == contents[3]
    assert contents[2].keys() == contents[0].keys() and contents[2] != contents[0]  # another seed, another order


def test_a_jsonl_corpus_of_many_shards_and_batches_yields_every_document_once(tmp_path, monkeypatch):
    # The corpus is far larger than an encoder batch or a shard, the memory the tokenizer holds.
    rng = np.random.default_rng(1)
    docs = [f"doc {i}: " + "word " * int(rng.integers(0, 30)) for i in range(400)] + ["doc 400: last"]
    docs[7] = docs[3]  # a duplicate is two documents
    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    monkeypatch.setattr(tc, "BATCH_CHARS", 200)
    out = tmp_path / "out"
    summary = tc.tokenize_corpus([path], out, "big", shard_tokens=1000, val_tokens=2003, encoding=BYTES, workers=2)
    found = read_all(out, "big")
    assert len(found) > 10
    assert sorted(p.name for p in out.iterdir()) == sorted(found)  # the temporary file is gone
    # Val then train in reading order is the document stream, the cut document whole again.
    got = split_documents(shard_stream(out, "big"), 256, decode_bytes)
    assert summary.cut and collections.Counter(got) == collections.Counter(docs)
    assert summary.val_documents == np.count_nonzero(found["big_val_000000.bin"] == 256)
    assert summary.documents == summary.val_documents + summary.train_documents == len(docs)
    # A shuffle of the whole corpus, not of a window: documents from the end of the file come early.
    first = [int(d.split(":")[0][4:]) for d in got[:40]]
    assert max(first) >= 360 and min(first) < 40, first


def test_a_failure_after_the_shuffle_leaves_the_folder_as_it_was(tmp_path, monkeypatch):
    folder = two_topic_folder(tmp_path, per_topic=5)
    out = tmp_path / "out"
    out.mkdir()
    (out / "other.bin").write_bytes(b"kept")
    real_write = shards.write_shard

    def write_then_fail(path, tokens):
        if "train_000002" in str(path):
            raise OSError(28, "No space left on device")
        real_write(path, tokens)

    monkeypatch.setattr(shards, "write_shard", write_then_fail)
    with pytest.raises(OSError, match="No space left"):
        tc.tokenize_corpus([folder], out, "c", shard_tokens=100, val_tokens=100, encoding=BYTES)
    assert [p.name for p in out.iterdir()] == ["other.bin"]  # no shard, partial or temporary file


def test_command_line_names_the_seed_and_the_split(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tc, "get_gpt2_encoding", lambda: BYTES)
    folder = two_topic_folder(tmp_path)
    out = tmp_path / "out"
    assert tc.main([str(folder), "--out", str(out), "--name", "c", "--val-tokens", "1500", "--seed", "3"]) == 0
    printed = capsys.readouterr().out.splitlines()
    found = read_all(out, "c")
    n_val = np.count_nonzero(found["c_val_000000.bin"] == 256)
    assert found["c_train_000001.bin"][0] != 256  # a document is cut: the line says where it counts
    assert printed == [
        f"60 documents shuffled with seed 3: {n_val} to validation, {60 - n_val} to training"
        "; the one cut between them counts in validation",
        f"{out / 'c_val_000000.bin'}: 1,500 tokens",
        f"{out / 'c_train_000001.bin'}: {found['c_train_000001.bin'].size:,} tokens",
    ]
    assert tc.main([str(folder), "--out", str(out), "--name", "c", "--keep-order", "--seed", "1", "--force"]) == 1
    assert capsys.readouterr().err == "error: --seed has no effect with --keep-order; pass one or the other\n"


def test_a_val_shard_of_val_tokens_plus_one_serves_train_gpts_validation(tmp_path):
    import train_gpt

    # train_gpt.py reads --val_tokens + 1 tokens, the last target; the default shard serves the record.
    assert tc.VAL_TOKENS == train_gpt.Hyperparameters().val_tokens + 1
    folder = two_topic_folder(tmp_path)
    for val_tokens in (1025, 1024):
        out = tmp_path / f"val{val_tokens}"
        tc.tokenize_corpus([folder], out, "c", val_tokens=val_tokens, encoding=BYTES)
        pattern = str(out / "c_val_*.bin")
        if val_tokens == 1025:
            assert train_gpt.validation_sequences(pattern, 1024, 1024, 257).shape == (1, 1025)
        else:
            with pytest.raises(train_gpt.DataError, match="hold only 1024 tokens"):
                train_gpt.validation_sequences(pattern, 1024, 1024, 257)
