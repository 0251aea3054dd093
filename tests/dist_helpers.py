"""train_gpt.py under torchrun with one thing changed, for tests/test_distributed.py (never imported by it).

    python -m torch.distributed.run ... tests/dist_helpers.py MODE [train_gpt.py options]

MODE is one of:
  nosync  gradient synchronization off: GradientBuckets' hooks launch nothing and wait_for_gradients()
          only counts the step. Validation's all_reduce and Muon's all_gather still run, so every rank
          trains on its own gradients; the comparison with one process must catch it.
  record  every bucket all-reduce launch is recorded (optimizer step, micro-step, bucket, whether it was
          the last micro-step, how many gradients of that backward were ready) and written with the
          buckets' parameter shapes and the bytes their hooks and waits copied (conftest.CopiedBytes)
          to $DIST_HELPERS_OUT/rank<R>.json, with Muon's rounds and each step's all-gathers (elements sent and
          received, bytes an element); each step's gradients, as each backward made them and as
          reduced, go to rank<R>_grads.pt (copied outside the counted hooks).
  fp8     FP8 faked on CPU (fp8_supported answers yes; the CPU's FP8 paths compute the GPU's math): the MLPs train
          through e4m3 copies, each rank's activation scales its own. The lm_head's FP8 is left out: its fixed scales
          hold no state, and CPU _scaled_mm (oneDNN's reference kernel) takes seconds a micro-batch.
  fail    train_gpt.py runs as __main__ (its own error handling), but rank 1 raises
          RuntimeError("injected failure on rank 1") instead of its 3rd gradient-bucket all-reduce.

The runs still log train_gpt.py's source: train_gpt.main() reads its own file.
"""

import json
import os
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import train_gpt  # noqa: E402
from copied_bytes import CopiedBytes  # noqa: E402  (this script's folder is on sys.path)

RANK = int(os.environ.get("RANK", 0))


class NoSyncBuckets(train_gpt.GradientBuckets):
    def _on_grad_ready(self, p):
        pass

    def wait_for_gradients(self):
        self.steps += 1


class RecordingBuckets(train_gpt.GradientBuckets):
    instances = []

    def __init__(self, params_in_ready_order, *args, **kwargs):
        super().__init__(params_in_ready_order, *args, **kwargs)
        self.params = params_in_ready_order
        self.num_params = len(params_in_ready_order)
        self.hook_calls = 0  # within the current optimizer step
        self.events = []
        self.copied_bytes = 0
        self.backward_grads = []  # [step][parameter]: the gradient of each backward, before it is accumulated
        self.reduced_grads = []  # [step][parameter]: the gradient the optimizer sees
        for i, p in enumerate(params_in_ready_order):
            p.register_hook(lambda grad, i=i: self._keep_backward_grad(i, grad))
        RecordingBuckets.instances.append(self)

    def _keep_backward_grad(self, i, grad):
        if len(self.backward_grads) == self.steps:
            self.backward_grads.append([[] for _ in self.params])
        self.backward_grads[self.steps][i].append(grad.detach().clone())

    def _on_grad_ready(self, p):
        self.hook_calls += 1  # every backward fires each parameter's hook exactly once
        before = list(self.handles)
        with CopiedBytes() as copied:
            super()._on_grad_ready(p)
        self.copied_bytes += copied.bytes
        for b, (old, new) in enumerate(zip(before, self.handles)):
            if old is None and new is not None:
                self.events.append(dict(step=self.steps, micro_step=(self.hook_calls - 1) // self.num_params,
                                        bucket=b, last_micro_step=self.last_micro_step,
                                        grads_ready=(self.hook_calls - 1) % self.num_params + 1))

    def wait_for_gradients(self):
        with CopiedBytes() as copied:
            super().wait_for_gradients()
        self.copied_bytes += copied.bytes
        self.hook_calls = 0
        self.reduced_grads.append([None if p.grad is None else p.grad.detach().clone() for p in self.params])

    def summary(self) -> dict:
        return dict(num_params=self.num_params, steps=self.steps, reductions=self.reductions, deferred=self.deferred,
                    bucket_shapes=[[list(p.shape) for p in bucket] for bucket in self.buckets], events=self.events,
                    copied_bytes=self.copied_bytes, grad_bytes=sum(p.numel() * p.element_size() for p in self.params))


class RecordingMuon(train_gpt.Muon):
    instances = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gathers = []  # [step][launch]
        RecordingMuon.instances.append(self)

    def step(self):
        launch, launched = dist.all_gather_into_tensor, []

        def counted(output, input, *args, **kwargs):
            launched.append(dict(sent=input.numel(), received=output.numel(), element_bytes=input.element_size()))
            return launch(output, input, *args, **kwargs)

        dist.all_gather_into_tensor = counted
        try:
            super().step()
        finally:
            dist.all_gather_into_tensor = launch
        self.gathers.append(launched)

    def summary(self) -> dict:
        return dict(gathers=self.gathers, mine=[list(p.shape) for p in self.dealt[self.rank]],
                    rounds=[[None if p is None else list(p.shape) for p in r] for r in self.rounds])


def fail_in_third_bucket_all_reduce():
    all_reduce, calls = dist.all_reduce, [0]

    def launch(*args, async_op=False, **kwargs):
        calls[0] += async_op and "group" not in kwargs  # the gradient buckets' (validation's waits; stop signals' has a group)
        if RANK == 1 and calls[0] == 3:
            raise RuntimeError("injected failure on rank 1")
        return all_reduce(*args, async_op=async_op, **kwargs)

    dist.all_reduce = launch


def run_train_gpt(argv):
    try:
        train_gpt.main(argv)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main():
    mode, argv = sys.argv[1], sys.argv[2:]
    if mode == "nosync":
        train_gpt.GradientBuckets = NoSyncBuckets
        run_train_gpt(argv)
    elif mode == "record":
        train_gpt.GradientBuckets, train_gpt.Muon = RecordingBuckets, RecordingMuon
        run_train_gpt(argv)
        out = Path(os.environ["DIST_HELPERS_OUT"])
        out.mkdir(parents=True, exist_ok=True)
        [muon] = RecordingMuon.instances
        (out / f"rank{RANK}.json").write_text(json.dumps([dict(b.summary(), muon=muon.summary())
                                                          for b in RecordingBuckets.instances]))
        [buckets] = RecordingBuckets.instances
        torch.save(dict(backward=buckets.backward_grads, reduced=buckets.reduced_grads), out / f"rank{RANK}_grads.pt")
    elif mode == "fp8":
        train_gpt.fp8_supported = lambda device: (True, "faked on CPU")
        build_model = train_gpt.build_model

        def mlps_in_fp8(*args, **kwargs):
            model = build_model(*args, **kwargs)
            assert model.fp8_scales is not None and all(block.mlp.fp8 for block in model.blocks)  # the plan's FP8
            model.fp8_scales = None
            return model
        train_gpt.build_model = mlps_in_fp8
        run_train_gpt(argv)
    elif mode == "fail":
        fail_in_third_bucket_all_reduce()
        sys.argv = [str(ROOT / "train_gpt.py"), *argv]
        runpy.run_path(sys.argv[0], run_name="__main__")
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
