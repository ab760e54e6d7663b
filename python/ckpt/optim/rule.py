"""What each algorithm of a staged optimizer declares once (docs/design: one UpdateRule per
algorithm), for the parts that convert, shard and check its state: torch's per-parameter state
keys and the ckpt state tensor behind each, and how the algorithm's parameters are laid out.
"""
from .. import _lib

# ckpt's FP32 master weights: every algorithm's, last in each parameter's torch state ("step"
# first), which torch's optimizers ignore.
MASTER_KEY = "master"
# ckpt's state tensors (slabs) as ckpt names them, in the order
# ckpt_optimizer_set_param_state takes them.
SLABS = {_lib.MASTER: "master", _lib.EXP_AVG: "exp_avg", _lib.EXP_AVG_SQ: "exp_avg_sq",
         _lib.MAX_EXP_AVG_SQ: "max_exp_avg_sq"}


class Rule:
    """One algorithm as a staged optimizer's parts see it: its name (for messages), its
    per-parameter state as torch's optimizer keys it (`state`: key -> the ckpt state tensor
    holding it, in torch's order; `aux`: the keys of state shaped unlike the parameter), the keys torch keeps only in a group with some option on
    (`needs`: key -> option; a loaded state may lack them), whether torch's optimizer counts
    each parameter's steps in its state, and whether each parameter stays whole on one rank
    when sharded. Declared once per algorithm class, never changed: safe to share."""

    __slots__ = ("name", "state", "needs", "counts_steps", "whole", "aux")

    def __init__(self, name, state, needs=None, counts_steps=True, whole=False, aux=()):
        self.name = name
        self.state = dict(state)
        self.needs = dict(needs or {})
        self.counts_steps = counts_steps
        self.whole = whole
        # State shaped unlike its parameter, in ckpt's aux slab (Adafactor's factors): (key,
        # applies(shape), shape(shape)) in the order the C++ rule declares them, which is the
        # order of a parameter's aux elements.
        self.aux = tuple(aux)

    def aux_keys(self, shape):
        """The aux state of a parameter of `shape`: [(key, its shape)], in slab order."""
        shape = tuple(shape)
        return [(key, tuple(shape_of(shape))) for key, applies, shape_of in self.aux
                if applies(shape)]

    def keys(self, group, slabs):
        """The state keys of a parameter of `group`, with their slabs, then the master's: those
        whose option the group has on and whose slab is among `slabs` (ckpt keeps it)."""
        return [(key, which) for key, which in self.state.items()
                if which in slabs and (key not in self.needs or group.get(self.needs[key]))] + \
            [(MASTER_KEY, _lib.MASTER)]

    def loadable(self):
        """Every state key a loaded state may hold, then the master's: (key, slab, whether a
        state without it is refused)."""
        return [(key, which, key not in self.needs) for key, which in self.state.items()] + \
            [(MASTER_KEY, _lib.MASTER, False)]
