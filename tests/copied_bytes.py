"""A dispatch mode that counts the bytes tensor copies write (tests/dist_helpers.py uses it under torchrun)."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class CopiedBytes(TorchDispatchMode):
    """Bytes written by the ops that copy tensor data (copy_, cat, clone, a dtype or device change),
    made while the mode is on."""

    COPIES = {torch.ops.aten.copy_.default, torch.ops.aten.cat.default, torch.ops.aten.cat.out,
              torch.ops.aten.clone.default, torch.ops.aten._to_copy.default}

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.COPIES:
            written = args[0] if func is torch.ops.aten.copy_.default else out
            self.bytes += written.numel() * written.element_size()
        return out
