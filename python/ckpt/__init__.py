"""ckpt: transactional, verifiable checkpoints of LLM training state (Python binding).

    import ckpt, ckpt.torch
    opt = ckpt.torch.StagedAdamW(model.named_parameters(), lr=3e-4, weight_decay=0.1)
    ck = ckpt.Checkpointer("/ckpts/run1", opt)
    ck.save(step, extra={"scheduler": sched.state_dict()})

Pure Python over libckpt_c.so through ctypes (see ckpt/_lib.py for where it is found), so one
build serves every Python and torch version. docs/python.md has the details.
"""
from ._lib import CkptError, Code
from .checkpointer import Checkpointer, PendingSave

__all__ = ["CkptError", "Checkpointer", "Code", "PendingSave"]
