"""ckpt.torch.StagedAdamW: AdamW (decoupled weight decay, as torch.optim.AdamW) over ckpt's
staged state. What is AdamW's lives here: its constructor and hyper-parameter checks, their
native form (ckpt_group), and its per-parameter state keys; everything else is the façade's
(optimizer.py).
"""
import torch

from .. import _lib
from .optimizer import _StagedOptimizer
from .params import _is_number
from .rule import Rule


def _torch_adamw_defaults():
    """The keyword arguments of this torch's AdamW with their defaults, as its param_groups and
    state dicts carry them (they differ between torch versions)."""
    keys = torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).defaults
    return {k: v for k, v in keys.items() if k not in ("lr", "betas", "eps", "weight_decay")}


def _check_implementation_choices(options):
    """torch AdamW's keyword arguments: those that only choose torch's implementation are
    accepted at any value; differentiable only at its default."""
    if options.get("differentiable"):
        raise NotImplementedError("StagedAdamW's step is not differentiable (differentiable=True)")
    if options.get("decoupled_weight_decay") is False:
        raise ValueError("StagedAdamW is AdamW: decoupled_weight_decay must be True")


def _check_betas(b):
    if (not isinstance(b, (tuple, list)) or len(b) != 2 or
            not all(_is_number(x) and 0 <= float(x) < 1 for x in b)):
        raise ValueError(f"betas must be two numbers in [0, 1), got {b!r}")


class StagedAdamW(_StagedOptimizer):
    """AdamW (decoupled weight decay, as torch.optim.AdamW) with ckpt's staged state.

    params: tensors, (name, tensor) pairs (names become the checkpoint's tensor names, e.g.
      `model.named_parameters()`, as HuggingFace names them), or param-group dicts of either.
      Each of float32, bfloat16 or float16 (mixed freely, each kept in its dtype), on the CPU
      and at most one CUDA device (the engine runs where most elements are; the others are
      staged through copies at each step).
    moments: "f32" (default) or "bf16" (moments rounded to BF16 in the slabs).
    threads: CPU engine threads (0: every core). unit_bytes: ckpt's unit size (0: default).
    engine: "auto" (default: where most elements are), "cpu" (CUDA parameters too: their
      gradients are copied to the host, stepped on every core, and the weights copied back; no
      GPU memory at all; an overlapped step then runs plainly) or "cuda".
    process_group: a torch.distributed group (e.g. torch.distributed.group.WORLD) over which the
      state is sharded ZeRO-1 style: each rank owns the pieces Megatron's buckets of
      `bucket_elems` elements (0: 40M) give it, steps only those, and the ranks then exchange
      the updated parameters; with reduce_grads the gradients are first averaged over the
      group in FP32 (leave it off when DDP already averaged them).
    overlap: update each parameter's state as soon as backward has finished its gradient, while
      backward goes on (torch >= 2.1; one process, no process_group), bit for bit the plain
      step: see docs/design/overlap.md and docs/python.md. Clip with `clip_grad_norm` (which
      leaves the gradients as they are) rather than torch's clip_grad_norm_, and wrap every
      micro-batch but the last of an accumulation in `with opt.accumulating():`.
      overlap="forward" (CUDA parameters) also hides the step's tail behind the next forward:
      what is left of the step when backward ends is written in parameter order (on the CPU
      engine: the weights' copies back to the GPU), and each module's forward waits (a forward
      pre-hook) only for its own parameters' writes. Code
      that reads the parameters outside their module's forward before the next forward (an
      EMA, a weight read in a parent module) calls `opt.wait_for_step()` first.
    torch AdamW's own keyword arguments are accepted: foreach, fused and capturable at any value
    (they choose torch's implementation), maximize (per group), amsgrad (per group;
    ckpt keeps max_exp_avg_sq once some group of the constructor or of add_param_group has
    it), and differentiable at its default (False); lr may be a tensor. As in torch, a
    parameter whose
    .grad is None is skipped and its own step count does not advance, and a parameter changed
    in place is continued from (docs/python.md states the contract and what still differs).
    Not thread-safe: one call at a time, as torch's optimizers.
    """

    # torch.optim.AdamW's state of a parameter: each key and the ckpt state tensor holding it,
    # declared once for `state`, state_dict(), local_state_dict() and load_state_dict()
    # (rule.py); max_exp_avg_sq only in a group with amsgrad, as torch keeps it.
    _adamw_rule = Rule("AdamW", {"exp_avg": _lib.EXP_AVG, "exp_avg_sq": _lib.EXP_AVG_SQ,
                                 "max_exp_avg_sq": _lib.MAX_EXP_AVG_SQ},
                       needs={"max_exp_avg_sq": "amsgrad"})

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, moments="f32", threads=0, unit_bytes=0,
                 process_group=None, bucket_elems=0, reduce_grads=True, overlap=False,
                 engine="auto", **torch_options):
        for key, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
            if not _is_number(value) or float(value) < 0:
                raise ValueError(f"{key} must be a number >= 0, got {value!r}")
        torch_defaults = _torch_adamw_defaults()
        unknown = sorted(set(torch_options) - set(torch_defaults))
        if unknown:
            raise TypeError(f"StagedAdamW got unexpected keyword arguments {unknown}")
        implementation = dict(torch_defaults)
        implementation.update(amsgrad=amsgrad, maximize=maximize, foreach=foreach,
                              capturable=capturable, differentiable=differentiable, fused=fused)
        implementation.update(torch_options)
        # The keys this torch's AdamW has, so that state dicts are interchangeable with it.
        implementation = {k: v for k, v in implementation.items() if k in torch_defaults}
        _check_implementation_choices(implementation)
        if (not isinstance(betas, (tuple, list)) or len(betas) != 2 or
                not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas)):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay, **implementation),
                         moments=moments, threads=threads, unit_bytes=unit_bytes,
                         process_group=process_group, bucket_elems=bucket_elems,
                         reduce_grads=reduce_grads, overlap=overlap, engine=engine)

    def _rule_of(self, group):
        return self._adamw_rule

    def _check_group_keys(self, g):
        """A param group's hyper-parameters, as torch AdamW accepts them (ValueError naming the
        key), and its implementation choices (ckpt's limits)."""
        for key in ("lr", "eps", "weight_decay"):
            v = g[key]
            if not _is_number(v) or not float(v) >= 0 or float(v) == float("inf"):
                raise ValueError(f"{key} must be a finite number >= 0, got {v!r}")
        _check_betas(g["betas"])
        _check_implementation_choices(g)
        if g.get("use_muon"):
            self._check_muon_group(g)

    def _check_muon_group(self, g):
        raise ValueError("use_muon: Muon groups are StagedMuon's (ckpt.torch.StagedMuon)")

    def _native_group(self, g):
        b1, b2 = g["betas"]
        return _lib.Group(float(g["lr"]), float(b1), float(b2), float(g["eps"]),
                          float(g["weight_decay"]), 0, int(bool(g.get("amsgrad", False))))

    def _from_native(self, c, g):
        g["lr"], g["betas"], g["eps"], g["weight_decay"] = (
            c.lr, (c.beta1, c.beta2), c.eps, c.weight_decay)
        g["amsgrad"] = bool(c.amsgrad)

    def exp_avg(self, p):
        """AdamW's first moment of parameter `p` (a copy)."""
        return self._of(p, self._adamw_rule.state["exp_avg"])

    def exp_avg_sq(self, p):
        """AdamW's second moment of parameter `p` (a copy)."""
        return self._of(p, self._adamw_rule.state["exp_avg_sq"])

    def max_exp_avg_sq(self, p):
        """AMSGrad's running maximum of exp_avg_sq for `p` (zeros in a group without
        amsgrad); ValueError when no group ever had amsgrad."""
        if not self._max_slab:
            raise ValueError("no param group of this optimizer has amsgrad: there is no "
                             "max_exp_avg_sq")
        return self._of(p, self._adamw_rule.state["max_exp_avg_sq"])
