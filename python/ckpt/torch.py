"""ckpt.torch: ckpt's staged optimizers for torch, the public import path.

StagedAdamW (torch.optim.AdamW), StagedMuon (torch.optim.Muon, with AdamW for the rest) and
StagedAdafactor (torch.optim.Adafactor) keep
their FP32 master weights and state in ckpt's host slabs and step each parameter in place;
checkpoints go through ckpt.Checkpointer. The implementation is the package ckpt.optim
(ckpt/optim/__init__.py lists its parts); docs/python.md is the user's guide.
"""
from . import _lib
from .optim import StagedAdafactor, StagedAdamW, StagedMuon

# ckpt's C library, importable from here as before. The optimizers' modules call it as
# ckpt._lib.lib: to fake a native call, patch the module that makes it (ckpt.optim.<part>.lib).
lib = _lib.lib

__all__ = ["StagedAdafactor", "StagedAdamW", "StagedMuon"]
