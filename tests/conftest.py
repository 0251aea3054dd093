import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

# Inductor's on-disk cache does not key its CPU kernels on ATEN_CPU_CAPABILITY: sessions under another capability
# reused kernels built under this machine's and computed wrong results or crashed. Such a session gets a cache of
# its own, new and removed at exit.
if "ATEN_CPU_CAPABILITY" in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"torchinductor_{os.environ['ATEN_CPU_CAPABILITY']}_")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)

import pytest  # noqa: E402
import torch  # noqa: E402
from torch._inductor.kernel.flex.flex_cpu import check_cpu_supported  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# pytest.ini runs the suite in two worker processes (pytest-xdist), one test file at a time each: a thread each, so
# that the two share the cores instead of contending for them (the tiny models' ops gain little from a second).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

SHARE_THE_CYCLE_MODEL = ("test_sample.py", "test_evaluate.py")  # one worker trains it (the trained fixture) for both


def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile (pytest.ini): a worker runs a test file at a time, its module fixtures made once; the files of
    SHARE_THE_CYCLE_MODEL go to one worker together."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharingTheCycleModel(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return "cycle model" if Path(scope).name in SHARE_THE_CYCLE_MODEL else scope

    return SharingTheCycleModel(config, log)


# FlexAttention's compiled CPU kernel needs AVX2 and a vectorized ATen (ATEN_CPU_CAPABILITY other than default):
# torch's own test of the platform decides, as in tools/gpu_check.py.
needs_flex_on_cpu = pytest.mark.skipif(not check_cpu_supported(), reason="FlexAttention's compiled CPU kernel needs "
                                       "AVX2 and ATEN_CPU_CAPABILITY other than default")


@pytest.fixture(autouse=True)
def restore_deterministic_algorithms():
    """A CPU Trainer switches torch's deterministic algorithms on for the whole process; each test
    starts from, and leaves, the setting it found."""
    before = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.utils.deterministic.fill_uninitialized_memory = before[1]

# --- data/ ---------------------------------------------------------------------------------
# The data scripts import their siblings by plain name, as when run as `python data/x.py`.
DATA_DIR = ROOT / "data"
sys.path.insert(0, str(DATA_DIR))

# The GPT-2 ranks beside the checkout keep tests fast and offline; data/cache is the project's
# own copy once a script has fetched it. Both are checked by sha256 when loaded.
RANKS_CANDIDATES = (ROOT.parent / "shared" / "fixtures" / "gpt2.tiktoken", DATA_DIR / "cache" / "gpt2.tiktoken")
NO_RANKS = "no local gpt2.tiktoken (../shared/fixtures or data/cache); the network-marked test covers the fetch"


def _ranks_file():
    return next((p for p in RANKS_CANDIDATES if p.is_file()), None)


# Every training run reads them too (run_support.gpt2_ranks: the prefix-token table), in this process and in the
# ones it starts: the local copy unless the environment names one.
if _ranks_file() is not None:
    os.environ.setdefault("GPT2_TIKTOKEN_FILE", str(_ranks_file()))


def _refuse_online(name):
    raise ConnectionError(f"tests do not download tiktoken's {name} files")


@pytest.fixture
def local_gpt2_ranks():
    """Path of a local gpt2.tiktoken, or None."""
    return _ranks_file()


@pytest.fixture
def gpt2_ranks_file(local_gpt2_ranks):
    """Path of a local gpt2.tiktoken; skips the test when there is none."""
    if local_gpt2_ranks is None:
        pytest.skip(NO_RANKS)
    return local_gpt2_ranks


@pytest.fixture
def no_tiktoken_download(monkeypatch):
    """Make tiktoken's own download fail at once, so tests never leave 127.0.0.1."""
    import tiktoken

    monkeypatch.setattr(tiktoken, "get_encoding", _refuse_online)


@pytest.fixture(scope="session")
def gpt2_encoding():
    """The GPT-2 Encoding built offline from a local ranks file (skips when there is none)."""
    path = _ranks_file()
    if path is None:
        pytest.skip(NO_RANKS)
    import gpt2_tokenizer
    import tiktoken

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiktoken, "get_encoding", _refuse_online)
        return gpt2_tokenizer.get_gpt2_encoding(path)


# --- train_gpt.py ----------------------------------------------------------------------------
sys.path.insert(0, str(ROOT))

# A machine whose NVIDIA GPUs this torch cannot use refuses to train on its CPU unless asked: the
# tests train on the CPU everywhere (tests/test_gpu_guard.py takes this setting away again).
os.environ.setdefault("TRAIN_GPT_ALLOW_CPU", "1")

# A model and batch small enough that a step takes a few tens of ms on 2 cores; fp32 so that
# comparisons between runs can be exact. A 1000-token vocabulary (padded to 1024): the GPT-2 one
# makes the lm_head and loss ten times the cost of the rest of a step at this size. Its tokens hold
# no <|endoftext|> (50256), so these runs are one document; test_model runs forward and backward
# over several documents on the real vocabulary, and test_masks checks their masks.
TINY_VOCAB = 1000
# What a model of the cpu preset's structure (4 layers, 2 heads: the fewest the record's structure takes), trained a
# few steps, needs of its end-of-run settings: no extension or momentum cooldown.
TINY_FORMS = ["--extension_steps=0", "--muon_momentum_cooldown_steps=0"]
TINY_RUN = ["--preset=cpu", *TINY_FORMS, "--num_layers=4", "--model_dim=64", "--num_heads=2", "--head_dim=32",
            "--seq_len=128", "--val_seq_len=128", "--val_tokens=1024", "--batch_slots=2", "--dtype=float32",
            "--compile=false", f"--vocab_size={TINY_VOCAB}", "--yarn=true",  # the record's rotary, rescaled at each window
            "--cooldown_frac=0.6"]  # runs of a few steps learn more with the lr held a while before it decays


@pytest.fixture(scope="session")
def tiny_shards(tmp_path_factory):
    """Learnable token shards: Zipf-distributed tokens below TINY_VOCAB. Returns the
    --train_files/--val_files arguments."""
    import numpy as np
    import shards

    folder = tmp_path_factory.mktemp("tiny_shards")
    rng = np.random.default_rng(0)
    for name, n in (("train", 60_000), ("val", 8_000)):
        tokens = (rng.zipf(1.2, n) - 1) % TINY_VOCAB
        shards.write_shard(folder / f"tiny_{name}_000000.bin", tokens)
    return [f"--train_files={folder}/tiny_train_*.bin", f"--val_files={folder}/tiny_val_*.bin"]


# --- the cycle model (test_sample.py, test_evaluate.py) -------------------------------------
EOT = 50256
CYCLE = 64  # the training data walks a cycle through tokens 0..63


def cycle_shards(folder):
    """Documents that follow one fixed cycle through 64 tokens (10% of tokens random, 1% document
    starts): a few steps teach it, and greedy generation then walks the cycle, each token depending
    on the context."""
    import numpy as np
    import shards

    rng = np.random.default_rng(0)
    order = rng.permutation(CYCLE)
    successor = np.empty(CYCLE, dtype=np.int64)
    successor[order] = np.roll(order, -1)
    for name, n in (("train", 10_000), ("val", 1_000)):
        tokens = np.empty(n, dtype=np.int64)
        tokens[0] = EOT
        for i in range(1, n):
            if rng.random() < 0.01:
                tokens[i] = EOT
            elif tokens[i - 1] == EOT or rng.random() < 0.1:
                tokens[i] = rng.integers(CYCLE)
            else:
                tokens[i] = successor[tokens[i - 1]]
        shards.write_shard(folder / f"cycle_{name}_000000.bin", tokens)
    return successor


# The record's embedding and scalar lrs, and a head lr giving the logits the steps that 0.22 gave them when
# the head divided by sqrt(width) (64 here): the cpu preset's lrs learn this toy cycle too slowly in a few steps.
FAST_ADAM_LRS = ["--head_lr=0.0275", "--embed_lr=0.6", "--scalar_lr=0.04"]


CYCLE_STEPS = 24  # Adam steps every second one, and the tied embedding follows the lm_head until 2/3 in


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """A 4-layer model (the cpu preset's structure: value embeddings, the skip into the attention-free layer, the
    backout, paired heads, XSA, the gate networks and dense connections) trained CYCLE_STEPS steps, eager, with
    FAST_ADAM_LRS and windows of 2 blocks (long) and 1 (short), validated at the end with 3 and 1 (its
    rotary rescaled from 2 to 3); returns (checkpoint path, successor table, the run's result). For
    test_sample.py and test_evaluate.py: one run a session (pytest_xdist_make_scheduler keeps them on one worker);
    test_train_loop's compiled test covers compiled training."""
    import train_gpt

    folder = tmp_path_factory.mktemp("cycle")
    successor = cycle_shards(folder)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    result = train_gpt.main([
        "--preset=cpu", *TINY_FORMS, "--num_layers=4", "--model_dim=64", "--num_heads=2", "--head_dim=32", "--seq_len=256",
        "--val_seq_len=256", "--val_tokens=512", "--batch_slots=1", "--dtype=float32", f"--num_iterations={CYCLE_STEPS}",
        "--window_stages=2", "--final_window=3", "--window_unit=128", "--yarn=true", "--cooldown_frac=0.6", *FAST_ADAM_LRS, "--save_checkpoint",
        "--compile=false",
        f"--train_files={folder}/cycle_train_*.bin",
        f"--val_files={folder}/cycle_val_*.bin", f"--log_dir={folder / 'logs'}", f"--checkpoint_dir={folder / 'ckpt'}",
        "--run_id=cycle"])
    torch.set_num_threads(threads)
    assert result["val_losses"][CYCLE_STEPS] < 2.5  # learned the cycle (uniform over 64 tokens would be 4.16)
    return result["checkpoints"][-1], successor, result
