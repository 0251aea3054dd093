import hashlib
import shutil
import time

import pytest
import tiktoken
import tiktoken.load

import gpt2_tokenizer
from gpt2_tokenizer import TokenizerError, get_gpt2_encoding

SAMPLE = "It's 2024: naïve café owners  didn't\tpay €1,000,000!\n\n  Ünïcödé 字 🤖 <b>end</b>  "


def assert_is_gpt2(enc):
    assert enc.name == "gpt2"
    assert enc.n_vocab == 50257
    assert enc.eot_token == 50256
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.encode(" the") == [262]
    assert enc.encode("Hello, world!") == [15496, 11, 995, 0]
    assert enc.encode("<|endoftext|>", allowed_special={"<|endoftext|>"}) == [50256]
    assert enc.decode(enc.encode(SAMPLE)) == SAMPLE


@pytest.fixture
def clean_env(monkeypatch, tmp_path, no_tiktoken_download):
    monkeypatch.delenv(gpt2_tokenizer.ENV_VAR, raising=False)
    return tmp_path / "empty-cache"


def test_offline_build_from_an_explicit_ranks_file(clean_env, gpt2_ranks_file):
    assert_is_gpt2(get_gpt2_encoding(gpt2_ranks_file, cache_dir=clean_env))
    assert not clean_env.exists()


def test_offline_build_from_the_environment_variable(clean_env, gpt2_ranks_file, monkeypatch):
    monkeypatch.setenv(gpt2_tokenizer.ENV_VAR, str(gpt2_ranks_file))
    assert_is_gpt2(get_gpt2_encoding(cache_dir=clean_env))


def test_offline_build_from_the_cache(clean_env, gpt2_ranks_file):
    clean_env.mkdir()
    shutil.copy(gpt2_ranks_file, clean_env / "gpt2.tiktoken")
    assert_is_gpt2(get_gpt2_encoding(cache_dir=clean_env))


def test_same_as_tiktokens_own_r50k_base(tmp_path, monkeypatch, gpt2_ranks_file, gpt2_encoding):
    """tiktoken builds r50k_base from these very ranks; fed from its cache, with downloads made
    impossible, it is an independent reference for the pattern and the special token."""
    url = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
    shutil.copy(gpt2_ranks_file, tmp_path / hashlib.sha1(url.encode()).hexdigest())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))

    def no_download(blobpath):
        raise AssertionError(f"tiktoken tried to download {blobpath}")

    monkeypatch.setattr(tiktoken.load, "read_file", no_download)
    reference = tiktoken.get_encoding("r50k_base")
    assert gpt2_encoding.n_vocab == reference.n_vocab
    assert gpt2_encoding._pat_str == reference._pat_str
    assert gpt2_encoding._special_tokens == reference._special_tokens
    text = SAMPLE * 3 + "<|endoftext|>" + SAMPLE
    assert gpt2_encoding.encode(text, allowed_special="all") == reference.encode(text, allowed_special="all")


@pytest.mark.parametrize("where", ["argument", "environment", "cache"])
def test_a_changed_byte_is_rejected_naming_the_file(clean_env, gpt2_ranks_file, monkeypatch, where):
    data = bytearray(gpt2_ranks_file.read_bytes())
    data[1000] ^= 0x01
    clean_env.mkdir()
    bad = clean_env / "gpt2.tiktoken"
    bad.write_bytes(bytes(data))
    if where == "environment":
        monkeypatch.setenv(gpt2_tokenizer.ENV_VAR, str(bad))
    with pytest.raises(TokenizerError) as err:
        get_gpt2_encoding(bad if where == "argument" else None, cache_dir=clean_env)
    assert str(err.value).startswith(f"{bad}: sha256 ")
    assert gpt2_tokenizer.RANKS_SHA256 in str(err.value)


def test_a_missing_file_in_the_environment_variable_is_named(clean_env, tmp_path, monkeypatch):
    missing = tmp_path / "nope.tiktoken"
    monkeypatch.setenv(gpt2_tokenizer.ENV_VAR, str(missing))
    with pytest.raises(TokenizerError, match=f"GPT2_TIKTOKEN_FILE={missing}: No such file"):
        get_gpt2_encoding(cache_dir=clean_env)


def test_tiktokens_own_encoding_is_used_when_it_loads(monkeypatch, tmp_path):
    own = object()
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: own if name == "gpt2" else None)
    assert get_gpt2_encoding(tmp_path / "not-there", cache_dir=tmp_path) is own


def test_a_stalled_download_does_not_hang(clean_env, gpt2_ranks_file, monkeypatch):
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: time.sleep(10))
    monkeypatch.setattr(gpt2_tokenizer, "ONLINE_TIMEOUT_S", 0.3)
    start = time.monotonic()
    assert_is_gpt2(get_gpt2_encoding(gpt2_ranks_file, cache_dir=clean_env))
    assert time.monotonic() - start < 5


def test_the_pattern_is_tiktokens_gpt2_pattern():
    openai_public = pytest.importorskip("tiktoken_ext.openai_public")
    assert gpt2_tokenizer.GPT2_PATTERN == openai_public.r50k_pat_str


def test_cache_ranks_keeps_a_valid_cache_as_it_is(clean_env, gpt2_ranks_file):
    """./run.sh test's step before the tests: a valid cached file is returned, read but not rewritten."""
    clean_env.mkdir()
    shutil.copy(gpt2_ranks_file, clean_env / "gpt2.tiktoken")
    before = (clean_env / "gpt2.tiktoken").stat()
    assert gpt2_tokenizer.cache_ranks(clean_env) == clean_env / "gpt2.tiktoken"
    after = (clean_env / "gpt2.tiktoken").stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # a rewrite is a new file


@pytest.mark.network
def test_cache_ranks_fetches_them_from_the_package_index(clean_env):
    """With an empty cache, the ranks come from the openai-whisper sdist on the package index, checked by sha256."""
    path = gpt2_tokenizer.cache_ranks(clean_env)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == gpt2_tokenizer.RANKS_SHA256
    assert_is_gpt2(get_gpt2_encoding(cache_dir=clean_env))
