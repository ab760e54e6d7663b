"""ckpt.optim: ckpt's staged optimizers as torch.optim.Optimizers (imported as ckpt.torch).

Layout; dependencies point one way, down this list (a part never imports the façade):
  adamw.py, muon.py, StagedAdamW, StagedMuon and StagedAdafactor: each algorithm's defaults,
  adafactor.py       hyper-parameter checks, native form and torch state keys, declared
                     once (a Rule)
  optimizer.py       _StagedOptimizer, the torch.optim.Optimizer façade: the native handle,
                     param_groups, step, state and state_dict, add_param_group, close
  state_dict.py      the state in torch's format and back, whole and sharded; `state`'s view
  overlap.py         the step hidden behind backward: gradient hooks, the forward gate
  sharding.py        ZeRO-1 over a process group: which rank owns which pieces, and the
                     all-reduce, gather, step and exchange of gradients, weights and state
  staging.py         where the plain step reads gradients and writes weights (strided copies)
  slabs.py           typed reads and writes of the native optimizer's state
  mirror.py          the CPU engine's pinned host mirror of CUDA parameters
  params.py, rule.py the parameter table and accepted inputs; what an algorithm declares
"""
from .adafactor import StagedAdafactor
from .adamw import StagedAdamW
from .muon import StagedMuon

__all__ = ["StagedAdafactor", "StagedAdamW", "StagedMuon"]
