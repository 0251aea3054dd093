import json
import re

import numpy as np
import pytest
import tiktoken

import gpt2_tokenizer
import shards
import tokenize_corpus as tc

# A byte-level encoding: token = byte value, <|endoftext|> = 256. Counts and contents can then
# be checked against the UTF-8 bytes of the inputs, independently of any BPE.
BYTES = tiktoken.Encoding(
    name="bytes", pat_str=r"[\s\S]+", mergeable_ranks={bytes([i]): i for i in range(256)},
    special_tokens={"<|endoftext|>": 256},
)


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


def test_inputs_become_documents_in_order_cut_into_shards(tmp_path):
    inputs, docs = write_inputs(tmp_path)
    out = tmp_path / "out"
    documents, written = tc.tokenize_corpus(inputs, out, "t", shard_tokens=40, val_tokens=30, encoding=BYTES)
    total = sum(len(d.encode("utf-8")) + 1 for d in docs)
    train_total = total - 30
    n_train = -(-train_total // 40)
    expected_names = ["t_val_000000.bin"] + [f"t_train_{i:06d}.bin" for i in range(1, n_train + 1)]
    found = read_all(out, "t")
    assert documents == len(docs)
    assert sorted(found) == sorted(expected_names)
    assert [(p.name, n) for p, n in written] == [(n, found[n].size) for n in expected_names]
    assert [found[n].size for n in expected_names] == [30] + [40] * (n_train - 1) + [train_total - 40 * (n_train - 1)]
    stream = np.concatenate([found[n] for n in expected_names])
    assert split_documents(stream, 256, lambda t: bytes(t).decode("utf-8")) == docs
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
    argv = [*map(str, inputs), "--out", str(out), "--name", "c", "--shard-tokens", "16", "--val-tokens", "8"]
    assert tc.main(argv + ["--workers", "2"]) == 0
    printed = capsys.readouterr().out
    assert "6 documents" in printed and f"{out / 'c_val_000000.bin'}: 8 tokens" in printed
    found = read_all(out, "c")
    stream = np.concatenate([found["c_val_000000.bin"]] + [found[f"c_train_{i:06d}.bin"] for i in range(1, len(found))])
    assert split_documents(stream, 50256, gpt2_tokenizer.get_gpt2_encoding().decode) == docs
    assert stream.tolist()[:5] == [50256, 5962, 3188, 13, 198]  # "First document.\n" in GPT-2 ids
    assert tc.main(argv) == 1
    assert capsys.readouterr().err.startswith(f"error: {out / 'c_train_000001.bin'} already exists")
