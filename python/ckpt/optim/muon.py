"""ckpt.torch.StagedMuon: torch.optim.Muon over ckpt's staged state, and the usual hybrid in
one optimizer (Muon for the 2-D matrices, AdamW for the rest). What is Muon's lives here: its
constructor and group defaults, its hyper-parameter checks and native form, and its state key;
its AdamW groups are StagedAdamW's (adamw.py).
"""
import torch

from .. import _lib
from .adamw import StagedAdamW
from .params import _is_number, _named
from .rule import Rule

# torch.optim.Muon's adjust_lr_fn values (None is "original").
_MUON_LR = {None: _lib.MUON_LR_ORIGINAL, "original": _lib.MUON_LR_ORIGINAL,
            "match_rms_adamw": _lib.MUON_LR_MATCH_RMS_ADAMW}


def _check_muon_keys(g):
    """A Muon group's own hyper-parameters, as torch.optim.Muon accepts them (ValueError
    naming the key)."""
    m = g["momentum"]
    if not _is_number(m) or not 0 <= float(m) < float("inf"):
        raise ValueError(f"momentum must be a finite number >= 0, got {m!r}")
    c = g["ns_coefficients"]
    if (not isinstance(c, (tuple, list)) or len(c) != 3 or
            not all(_is_number(x) and abs(float(x)) < float("inf") for x in c)):
        raise ValueError(f"ns_coefficients must be three finite numbers, got {c!r}")
    s = g["ns_steps"]
    if not isinstance(s, int) or isinstance(s, bool) or not 0 <= s < 100:
        raise ValueError(f"ns_steps must be an int in [0, 100), got {s!r}")
    if g["adjust_lr_fn"] not in _MUON_LR:
        raise ValueError(f"adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got "
                         f"{g['adjust_lr_fn']!r}")
    if g.get("amsgrad") or g.get("maximize"):
        raise ValueError("amsgrad and maximize are AdamW's: a Muon group has neither")


class StagedMuon(StagedAdamW):
    """torch.optim.Muon with ckpt's staged state, and the usual hybrid in one optimizer: Muon
    for the 2-D matrices, AdamW for the rest (docs/design/muon.md, docs/python.md).

    Its constructor is torch.optim.Muon's: lr, weight_decay, momentum, nesterov,
    ns_coefficients, eps, ns_steps and adjust_lr_fn, the defaults of every group. A group with
    "use_muon": False is stepped with AdamW: its lr, betas, eps and weight_decay are its own, or
    adamw_lr (default: lr), adamw_betas, adamw_eps and adamw_weight_decay (default:
    weight_decay). Muon groups take 2-D parameters only, each stepped whole: its FP32 master and
    momentum buffer live in ckpt's host slabs, and the Newton-Schulz iteration runs as torch's
    (BF16 operands, FP32 sums, one rounding per product): for CUDA parameters on the GPU, each
    matrix streamed through slots sized by the largest one (the CUDA engine; on a GPU older than
    compute capability 8.0 the CPU engine, the parameters staged through host copies), for CPU
    ones on every core of the CPU.
    state_dict() is torch's shape: {"momentum_buffer", "step", "master"} for a Muon parameter,
    AdamW's entries for the others; load_state_dict() takes torch.optim.Muon's too.

    ckpt.Checkpointer saves and loads it as StagedAdamW (a Muon parameter's step holds its
    master and optimizer.momentum.<name>); a checkpoint whose groups step with another algorithm
    is refused (load_model keeps the weights alone). process_group, bucket_elems and
    reduce_grads are StagedAdamW's, but each Muon matrix lies whole on one rank (the largest
    first, onto the rank with the fewest elements). Not yet: overlap. moments "bf16" keeps the
    momentum in BF16.
    Not thread-safe: one call at a time, as torch's optimizers.
    """

    _min_capability = 8
    # torch.optim.Muon's state of a parameter of a Muon group, and ckpt's slab holding it
    # (rule.py); torch's Muon counts no steps, and each matrix lies whole on one rank for its
    # Newton-Schulz iterations (docs/design/muon.md).
    _muon_rule = Rule("Muon", {"momentum_buffer": _lib.EXP_AVG}, counts_steps=False, whole=True)

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=(3.4445, -4.775, 2.0315), eps=1e-7, ns_steps=5,
                 adjust_lr_fn=None, *, adamw_lr=None, adamw_betas=(0.9, 0.999), adamw_eps=1e-8,
                 adamw_weight_decay=None, moments="f32", threads=0, unit_bytes=0,
                 process_group=None, bucket_elems=0, reduce_grads=True, engine="auto"):
        self._muon_defaults = dict(
            use_muon=True, momentum=momentum, nesterov=bool(nesterov),
            ns_coefficients=tuple(ns_coefficients) if isinstance(ns_coefficients, (tuple, list))
            else ns_coefficients, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        _check_muon_keys(self._muon_defaults)
        self._adamw_defaults = dict(
            lr=lr if adamw_lr is None else adamw_lr, betas=tuple(adamw_betas), eps=adamw_eps,
            weight_decay=weight_decay if adamw_weight_decay is None else adamw_weight_decay)
        # The parameters' names, for add_param_group's messages; passed on named as given.
        params, self._name_hint = _named(params)

        def named(items):
            return [(self._name_hint[id(t)], t) if id(t) in self._name_hint else t
                    for t in items]
        params = ([dict(g, params=named(g["params"])) for g in params]
                  if params and isinstance(params[0], dict) else named(params))
        super().__init__(params, lr=lr, betas=adamw_betas, eps=eps, weight_decay=weight_decay,
                         moments=moments, threads=threads, unit_bytes=unit_bytes,
                         process_group=process_group, bucket_elems=bucket_elems,
                         reduce_grads=reduce_grads, engine=engine)

    def add_param_group(self, param_group):
        """torch's add_param_group: a group is Muon's unless it says "use_muon": False, and
        takes Muon's or AdamW's defaults accordingly."""
        if isinstance(param_group, dict):
            param_group = dict(param_group)
            use = param_group.setdefault("use_muon", True)
            if not isinstance(use, bool):
                raise ValueError(f"use_muon must be True or False, got {use!r}")
            for key, value in (self._muon_defaults if use else self._adamw_defaults).items():
                param_group.setdefault(key, value)
            if use:  # As torch.optim.Muon: a ValueError, naming the parameter.
                params = param_group.get("params")
                items = [params] if isinstance(params, torch.Tensor) else list(params or ())
                param_group["params"] = items
                hint = getattr(self, "_name_hint", {})
                for i, item in enumerate(items):
                    name, t = item if isinstance(item, tuple) and len(item) == 2 else (None, item)
                    name = name or hint.get(id(t))
                    if isinstance(t, torch.Tensor) and t.dim() != 2:
                        raise ValueError(f"Muon only supports 2-D parameters: "
                                         f"{name or f'parameter {i} of the group'} has size "
                                         f"{tuple(t.shape)} (give it a use_muon=False group)")
        super().add_param_group(param_group)

    def _rule_of(self, group):
        return self._muon_rule if group.get("use_muon") else self._adamw_rule

    def _check_muon_group(self, g):
        if "momentum" not in g:  # Not a StagedMuon's group.
            super()._check_muon_group(g)
        _check_muon_keys(g)

    def _native_group(self, g):
        c = super()._native_group(g)
        if g.get("use_muon"):  # docs/design/muon.md
            c.algorithm = _lib.MUON
            c.momentum = float(g["momentum"])
            c.nesterov = int(bool(g["nesterov"]))
            c.ns_a, c.ns_b, c.ns_c = (float(x) for x in g["ns_coefficients"])
            c.ns_steps = int(g["ns_steps"])
            c.adjust_lr = _MUON_LR[g["adjust_lr_fn"]]
        return c

    def _from_native(self, c, g):
        super()._from_native(c, g)
        if c.algorithm == _lib.MUON:
            g["momentum"], g["nesterov"] = c.momentum, bool(c.nesterov)
            g["ns_coefficients"] = (c.ns_a, c.ns_b, c.ns_c)
            g["ns_steps"] = c.ns_steps
            if c.adjust_lr == _lib.MUON_LR_MATCH_RMS_ADAMW:
                g["adjust_lr_fn"] = "match_rms_adamw"
            elif g.get("adjust_lr_fn") == "match_rms_adamw":
                g["adjust_lr_fn"] = None  # torch's default, "original".
