"""ckpt.torch.StagedAdafactor: torch.optim.Adafactor over ckpt's staged state
(docs/design/adafactor.md). What is Adafactor's lives here: its constructor, group defaults
and checks (torch's), their native form (lr and weight_decay in ckpt_group, the rest by name),
and its state keys (row_var and col_var, shaped unlike the parameter, or variance).
"""
import torch

from .. import _lib
from .optimizer import _StagedOptimizer
from .params import _is_number
from .rule import Rule

# The hyper-parameters ckpt's Adafactor rule keeps by name (optimizer/rules/adafactor/).
_NAMED = ("beta2_decay", "eps1", "eps2", "d", "maximize")


def _row_shape(shape):
    return shape[:-1] + (1,)


def _col_shape(shape):
    return shape[:-2] + (1,) + shape[-1:]


def _check_adafactor_keys(g):
    """A group's hyper-parameters, as torch.optim.Adafactor checks them (ValueError naming the
    key), with finite values (ckpt's)."""
    def number(key, value, ok, what):
        if not _is_number(value) or not ok(float(value)) or float(value) in (float("inf"),
                                                                               float("-inf")):
            raise ValueError(f"{key} should be {what} but is: {value!r}")
    number("lr", g["lr"], lambda v: v >= 0, ">= 0")
    number("beta2_decay", g["beta2_decay"], lambda v: v <= 0, "<= 0")
    eps = g["eps"]
    if not isinstance(eps, (tuple, list)) or len(eps) != 2:
        raise ValueError(f"eps should be (eps1 or None, eps2) but is: {eps!r}")
    if eps[0] is not None:
        number("epsilon1", eps[0], lambda v: v >= 0, ">= 0")
    number("epsilon2", eps[1], lambda v: v >= 0, ">= 0")
    number("Clipping threshold d", g["d"], lambda v: v >= 1, ">= 1")
    number("weight_decay", g["weight_decay"], lambda v: v >= 0, ">= 0")
    if not isinstance(g.get("maximize", False), bool):
        raise ValueError(f"maximize should be True or False but is: {g['maximize']!r}")


class StagedAdafactor(_StagedOptimizer):
    """torch.optim.Adafactor with ckpt's staged state (docs/design/adafactor.md).

    Its constructor is torch.optim.Adafactor's: lr (default 1e-2), beta2_decay (-0.8),
    eps=(eps1, eps2) ((None, 1e-3); eps1 None is the machine epsilon of the parameter's dtype),
    d (1.0), weight_decay (0.0), and foreach (accepted, any value) and maximize; each group may
    have its own. A parameter of two or more dimensions keeps its second moment as a row and
    a column factor (torch's row_var and col_var, of its shape with the last, and the second
    last, dimension 1); a vector or scalar keeps it whole (variance). They and the FP32 masters
    live in ckpt's host memory: state_dict() is torch's shape ({"step", "row_var", "col_var"}
    or {"step", "variance"}, and "master") and load_state_dict() takes torch.optim.Adafactor's.
    Steps run on every CPU core (engine "cpu"; CUDA parameters are staged through host copies:
    ckpt's CUDA engine has no Adafactor kernels yet), within 1e-5 of torch's Adafactor on FP32
    parameters (its sums are kept in double). ckpt.Checkpointer saves and loads it as it does
    StagedAdamW (reshard: each parameter and its factors whole on one rank).
    Not yet: process_group, overlap. Not thread-safe: one call at a time, as torch's optimizers.
    """

    # torch.optim.Adafactor's state of a parameter: none in ckpt's moment slabs, and its factors
    # (or variance) in the aux slab, in the order ckpt's rule declares them; every parameter
    # stepped whole (its norms scale its step).
    _adafactor_rule = Rule("Adafactor", {}, whole=True, aux=(
        ("row_var", lambda s: len(s) >= 2, _row_shape),
        ("col_var", lambda s: len(s) >= 2, _col_shape),
        ("variance", lambda s: len(s) < 2, lambda s: s)))

    def __init__(self, params, lr=1e-2, beta2_decay=-0.8, eps=(None, 1e-3), d=1.0,
                 weight_decay=0.0, *, foreach=None, maximize=False, moments="f32", threads=0,
                 unit_bytes=0, process_group=None, engine="cpu"):
        defaults = dict(lr=lr, beta2_decay=beta2_decay, eps=tuple(eps) if isinstance(
            eps, (tuple, list)) else eps, d=d, weight_decay=weight_decay, foreach=foreach,
            maximize=maximize)
        _check_adafactor_keys(defaults)
        if process_group is not None:
            raise NotImplementedError("StagedAdafactor with a process_group is not built yet")
        if engine == "cuda":
            raise NotImplementedError("ckpt's CUDA engine has no Adafactor kernels yet: use "
                                      "engine='cpu' (CUDA parameters are staged through the host)")
        super().__init__(params, defaults, moments=moments, threads=threads,
                         unit_bytes=unit_bytes, process_group=None, bucket_elems=0,
                         reduce_grads=False, overlap=False, engine=engine)

    def _rule_of(self, group):
        return self._adafactor_rule

    def _grad_scale(self):
        # maximize is the rule's (it negates the gradients itself): the step's scale stays 1.
        return 1.0, frozenset()

    def _check_group_keys(self, g):
        _check_adafactor_keys(g)

    def _native_group(self, g):
        c = _lib.Group(float(g["lr"]), 0.9, 0.999, 1e-8, float(g["weight_decay"]), 0, 0)
        c.algorithm = _lib.ADAFACTOR
        return c

    def _native_hyper(self, g):
        eps1, eps2 = g["eps"]
        return {"beta2_decay": float(g["beta2_decay"]),
                "eps1": None if eps1 is None else float(eps1), "eps2": float(eps2),
                "d": float(g["d"]), "maximize": 1.0 if g.get("maximize") else 0.0}

    def _from_native(self, c, g):
        g["lr"], g["weight_decay"] = c.lr, c.weight_decay

    def _from_native_hyper(self, hyper, g):
        g["beta2_decay"], g["d"] = hyper["beta2_decay"], hyper["d"]
        g["eps"] = (hyper["eps1"], hyper["eps2"])
        g["maximize"] = bool(hyper["maximize"])

    def factors(self, p):
        """Parameter `p`'s second-moment state as torch keeps it: {"row_var", "col_var"} or
        {"variance"} (copies; zeros before its first step)."""
        entry = self.state.get(p)
        keys = self._adafactor_rule.aux_keys(tuple(p.shape))
        return {k: entry[k].clone() if entry is not None else torch.zeros(s) for k, s in keys}
