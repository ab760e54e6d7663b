"""The optimizer's state in torch's format and back: ckpt's flat state tensors (slabs, this
rank's elements in slab order) as torch's per-parameter state entries, whole or this rank's
shard, and state dicts (torch's, torch.optim.Muon's, or a shard from local_state_dict()) as
slab arrays to load. Which keys a parameter has comes from its algorithm's Rule (rule.py);
every function here is told the parameter table, the rules and the arrays it converts.
"""
import bisect
import math

import torch

from .. import _lib
from .params import _is_number
from .rule import SLABS


class _StateView:
    """`optimizer.state` as torch's optimizers have it: for each parameter that has been stepped,
    a dict of "step", its algorithm's state keys (AdamW's "exp_avg", "exp_avg_sq",
    "max_exp_avg_sq" in a group with amsgrad; Muon's "momentum_buffer") and "master" (ckpt's FP32
    master weights), CPU copies in the parameter's shape. Read-only. With a process group it is
    this rank's, as torch's sharded optimizers keep theirs, and reading it involves no other
    rank: a parameter is there when this rank owns some of its elements, its tensors holding
    those elements and zero at the ones other ranks own (state_dict(), collective, has the whole
    state). `read()` (a weak method of the optimizer that owns the view) gives {id(param):
    entry}; `params` is its parameter list. Not thread-safe: the optimizer's thread."""

    def __init__(self, read, params):
        self._read = read
        self._params = params

    def _state(self):
        return self._read()()

    def __getitem__(self, param):
        if not any(param is p for p in self._params):
            raise KeyError("not a parameter of this optimizer")
        # A dict of its own: what a caller puts in it (Lightning's _optimizer_to_device moves
        # each entry to the GPU by assigning into it) neither changes the next read nor stays
        # alive in the cache (a GPU copy of the whole state would).
        return dict(self._state().get(id(param), {}))

    def __contains__(self, param):
        return id(param) in self._state()

    def __iter__(self):
        by_id = self._state()
        return iter([p for p in self._params if id(p) in by_id])

    def __len__(self):
        return len(self._state())

    def __bool__(self):
        return len(self) > 0

    def keys(self):
        return list(iter(self))

    def values(self):
        return (self[p] for p in self)  # One entry at a time (see __getitem__).

    def items(self):
        return ((p, self[p]) for p in self)

    def get(self, param, default=None):
        return self[param] if param in self else default

    def __setitem__(self, param, value):
        raise TypeError("StagedAdamW's state lives in ckpt's slabs: change it with "
                        "load_state_dict() or ckpt.Checkpointer.load()")


def entry_step(entry, name):
    """A state entry's step count, as an int (KeyError without one, ValueError for a step that
    is not a count)."""
    if "step" not in entry:
        # As torch's AdamW, whose step reads state["step"]: a state without one is no
        # AdamW state (it is not taken as step 0).
        raise KeyError(f"the state of parameter {name} has no 'step'")
    step = entry["step"]
    step = step.item() if isinstance(step, torch.Tensor) else step
    if not _is_number(step) or not 0 <= step < 2**64 or step != int(step):
        raise ValueError(f"the step of parameter {name} is {step!r}, not a count (an "
                         f"integer in [0, 2**64))")
    return int(step)


def aux_layout(table, rules):
    """Where each parameter's aux state (Rule.aux: state shaped unlike it) lies in the aux slab
    of an optimizer without a process group (its pieces are its parameters, in order): per
    parameter [(key, shape, offset)], and the aux size; (None, 0) when no rule keeps any."""
    if not any(rule.aux for rule, _ in rules):
        return None, 0
    at, out = 0, []
    for p, (rule, _) in zip(table.params, rules):
        keys = []
        for key, shape in rule.aux_keys(p.shape):
            keys.append((key, shape, at))
            at += math.prod(shape)
        out.append(keys)
    return out, at


def torch_state(table, steps, full, rules, aux=None):
    """{id(param): entry} of the parameters that have been stepped (torch keeps no state before
    a parameter's first step), from `full` (slab -> one whole state tensor over every
    parameter), `rules` ((Rule, group) of each parameter) and `aux` ((the aux slab,
    aux_layout's list), or None)."""
    out = {}
    for i, (p, (o, n), step, (rule, group)) in enumerate(
            zip(table.params, table.slices, steps, rules)):
        if step == 0:
            continue
        entry = {"step": torch.tensor(float(step))}
        for key, shape, at in (aux[1][i] if aux is not None else ()):
            entry[key] = aux[0][at:at + math.prod(shape)].view(shape).clone()
        for key, which in rule.keys(group, full):
            entry[key] = full[which][o:o + n].view(p.shape).clone()
        out[id(p)] = entry
    return out


def local_torch_state(table, steps, local, owned, rules):
    """torch_state's entries for this rank's pieces only (`owned`, from `local`: slab -> this
    rank's elements): elements of a parameter owned elsewhere are zero."""
    starts = [o for o, _ in table.slices]
    out, sources = {}, {}  # sources: id(p) -> [(entry key, slab read into it)].
    for flat_at, local_at, n in owned:
        if n == 0:
            continue  # A parameter of no elements: nothing of it is this rank's.
        i = bisect.bisect_right(starts, flat_at) - 1
        p, o = table.params[i], starts[i]
        if steps[i] == 0:
            continue
        if id(p) not in out:
            rule, group = rules[i]
            sources[id(p)] = rule.keys(group, local)
            out[id(p)] = {"step": torch.tensor(float(steps[i])),
                          **{key: torch.zeros(p.shape) for key, _ in sources[id(p)]}}
        at = flat_at - o
        for key, which in sources[id(p)]:
            out[id(p)][key].view(-1)[at:at + n].copy_(local[which][local_at:local_at + n])
    return out


def shard_pieces(owned, slices):
    """This rank's pieces as (parameter index, first element, count, slab offset); without a
    process group (owned None) each parameter whole."""
    owned = owned if owned is not None else [(o, o, n) for o, n in slices]
    starts = [o for o, _ in slices]
    out = []
    for flat_at, local_at, n in owned:
        i = bisect.bisect_right(starts, flat_at) - 1
        out.append((i, flat_at - starts[i], n, local_at))
    return out


def shard_state(steps, local, pieces, rules):
    """local_state_dict()'s "state": {index: entry} of the stepped parameters this rank owns
    pieces of, each tensor 1-D, the elements of its pieces in order."""
    state = {}
    for i in sorted({i for i, _, _, _ in pieces}):
        if steps[i] == 0:
            continue
        parts = [(at, n) for j, _, n, at in pieces if j == i]
        rule, group = rules[i]
        entry = {"step": torch.tensor(float(steps[i]))}
        for key, which in rule.keys(group, local):
            entry[key] = torch.cat([local[which][at:at + n] for at, n in parts])
        state[i] = entry
    return state


def _zeroed_arrays(master, count):
    """slab -> array to load: `master`, and zeros for the other slabs (a slab a state dict does
    not fill, e.g. AMSGrad's maximum where absent, loads as zeros)."""
    return {which: master if which == _lib.MASTER else torch.zeros(count, dtype=torch.float32)
            for which in SLABS}


def whole_arrays(table, saved_ids, state, rules, local_of):
    """A whole state dict (`state`, keyed by `saved_ids`: the ids its param_groups list, in
    parameter order) as this rank's arrays (one per slab, in SLABS order; `local_of` takes
    this rank's elements of a flat tensor), and every parameter's step count. The masters
    start from the parameters' values where the dict has no "master"."""
    master = torch.empty(table.total, dtype=torch.float32)
    arrays = _zeroed_arrays(master, table.total)
    steps = [0] * len(table.params)
    layout, aux_size = aux_layout(table, rules)
    aux = torch.zeros(aux_size, dtype=torch.float32) if layout is not None else None
    for i, (p, saved_id) in enumerate(zip(table.params, saved_ids)):
        name, (o, n) = table.names[i], table.slices[i]
        with torch.no_grad():
            master[o:o + n].copy_(p.detach().reshape(-1).float().cpu())
        entry = state.get(saved_id)
        if not entry:
            continue
        rule = rules[i][0]
        for key, which, required in rule.loadable():
            if key not in entry:
                if not required:
                    continue
                raise ValueError(f"the state of parameter {name} has no {key}")
            t = torch.as_tensor(entry[key]).detach()
            if t.numel() != n:
                raise ValueError(f"{key} of parameter {name} has {t.numel()} elements, "
                                 f"the parameter {n}")
            if t.shape != p.shape:
                # Same count, other shape: its elements would land scrambled (torch's
                # AdamW fails at the step).
                raise ValueError(f"{key} of parameter {name} has shape "
                                 f"{list(t.shape)}, the parameter {list(p.shape)}")
            arrays[which][o:o + n].copy_(t.reshape(-1).float().cpu())
        for key, shape, at in (layout[i] if layout is not None else ()):
            if key not in entry:
                raise ValueError(f"the state of parameter {name} has no {key}")
            t = torch.as_tensor(entry[key]).detach()
            if tuple(t.shape) != shape:
                raise ValueError(f"{key} of parameter {name} has shape {list(t.shape)}, "
                                 f"{rule.name} keeps {list(shape)} for it")
            aux[at:at + t.numel()].copy_(t.reshape(-1).float().cpu())
        # torch's Muon counts no steps: a parameter with a momentum buffer has taken one.
        steps[i] = entry_step(entry if rule.counts_steps or "step" in entry else {"step": 1},
                              name)
    return [local_of(arrays[which]) for which in SLABS], steps, aux


def _shard_steps(shard, table, pieces, rank, world):
    """The step counts of a shard saved by this rank at this layout (ValueError, on every rank
    alike, for a shard of another rank or layout)."""
    theirs = [list(map(int, q)) for q in shard.get("pieces", ())]
    if (shard.get("world_size") != world or shard.get("rank") != rank or
            theirs != [[i, b, n] for i, b, n, _ in pieces]):
        raise ValueError(f"the state dict is the shard of rank {shard.get('rank')} of "
                         f"{shard.get('world_size')}, and this is rank {rank} of {world}, "
                         "which owns other pieces: each rank loads its own shard, saved at "
                         "this layout; at another world size load a whole state dict "
                         "(consolidate_state_dict) or use ckpt.Checkpointer")
    steps = shard.get("param_steps")
    if not isinstance(steps, (list, tuple)) or len(steps) != len(table.params):
        raise ValueError("the shard's param_steps do not list every parameter")
    return [entry_step({"step": s}, table.names[i]) for i, s in enumerate(steps)]


def shard_arrays(shard, state, table, pieces, rules, rank, world, local_of, local_count):
    """This rank's own shard (local_state_dict()) as its arrays (one per slab, in SLABS order)
    and the step counts."""
    steps = _shard_steps(shard, table, pieces, rank, world)
    flat = torch.cat([p.detach().reshape(-1).float().cpu() for p in table.params])
    arrays = _zeroed_arrays(local_of(flat).clone(), local_count)
    for i in {i for i, _, _, _ in pieces}:
        entry = state.get(i)
        if not entry:
            continue
        parts = [(at, n) for j, _, n, at in pieces if j == i]
        count = sum(n for _, n in parts)
        for key, which, required in rules[i][0].loadable():
            if key not in entry:
                if not required:
                    continue
                raise ValueError(f"the shard of parameter {table.names[i]} has no {key}")
            t = torch.as_tensor(entry[key]).detach().reshape(-1).float().cpu()
            if t.numel() != count:
                raise ValueError(f"{key} of parameter {table.names[i]} has {t.numel()} "
                                 f"elements in the shard, this rank owns {count}")
            done = 0
            for at, n in parts:
                arrays[which][at:at + n].copy_(t[done:done + n])
                done += n
    return [arrays[which] for which in SLABS], steps


def shard_aux(state, layout, aux):
    """local_state_dict()'s entries (`state`, by index) with their parameters' aux state (as
    aux_layout lays it out in `aux`), each key 1-D as the shard's tensors are."""
    for i, entry in state.items():
        for key, shape, at in layout[i]:
            entry[key] = aux[at:at + math.prod(shape)].clone()


def shard_aux_array(state, table, layout, size):
    """The aux slab a shard's entries (`state`, by index) hold; ValueError naming the parameter
    and key missing or of the wrong size."""
    aux = torch.zeros(size, dtype=torch.float32)
    for i, keys in enumerate(layout):
        entry = state.get(i)
        if not entry:
            continue
        for key, shape, at in keys:
            if key not in entry:
                raise ValueError(f"the shard of parameter {table.names[i]} has no {key}")
            t = torch.as_tensor(entry[key]).detach().reshape(-1).float().cpu()
            if t.numel() != math.prod(shape):
                raise ValueError(f"{key} of parameter {table.names[i]} has {t.numel()} "
                                 f"elements in the shard, its shape {list(shape)} "
                                 f"{math.prod(shape)}")
            aux[at:at + t.numel()].copy_(t)
    return aux


def indexed_groups(param_groups):
    """param_groups as a state dict has them: hyper-parameters, and the parameters' indices
    (numbered in group order, as torch numbers them)."""
    groups, index = [], 0
    for g in param_groups:
        n = len(g["params"])
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       "params": list(range(index, index + n))})
        index += n
    return groups


def merged_groups(param_groups, groups, check_group, max_slab):
    """These param groups with a state dict's hyper-parameters, each validated by
    `check_group(group, index)` (ValueError naming what does not fit)."""
    if len(groups) != len(param_groups):
        raise ValueError(f"the state dict has {len(groups)} param groups, this optimizer "
                         f"{len(param_groups)}")
    new_groups = []
    for gi, (ours, theirs) in enumerate(zip(param_groups, groups)):
        if len(theirs.get("params", ())) != len(ours["params"]):
            raise ValueError(f"param group {gi} has {len(theirs.get('params', ()))} "
                             f"parameters in the state dict, {len(ours['params'])} here")
        group = {**ours, **{k: val for k, val in theirs.items() if k != "params"}}
        if bool(group.get("use_muon")) != bool(ours.get("use_muon")):
            raise ValueError(
                f"param group {gi} is {'Muon' if theirs.get('use_muon') else 'AdamW'}'s in "
                f"the state dict and {'Muon' if ours.get('use_muon') else 'AdamW'}'s here: a "
                "group's algorithm is fixed when it is added")
        check_group(group, gi)
        new_groups.append(group)
    if not max_slab and any(g.get("amsgrad") for g in new_groups):
        raise ValueError("the state dict's param groups use amsgrad, and this optimizer keeps "
                         "no max_exp_avg_sq: build it with amsgrad=True in those groups")
    return new_groups


class _TorchState:
    """One optimizer's state in torch's format, made from ckpt's slabs on demand and kept until
    the state changes (changed(): a step, a load, an edit taken in): the whole state by
    parameter (collective when sharded), this rank's (what `optimizer.state` shows), and the
    whole state consolidated on one rank (consolidate_state_dict). The optimizer owns it,
    shared by wrappers that copy its __dict__; it borrows the parameter table, the sharding
    (None without a process group) and the slabs. Each call is told the parameters' (Rule,
    group), the slabs ckpt keeps (`kept`) and how to take in the trainer's edits first
    (`refresh`). Not thread-safe: the optimizer's calls, one at a time."""

    def __init__(self, table, shards, slabs):
        self.table, self.shards, self.slabs = table, shards, slabs
        self.cache = {}
        # (rank, its whole state there or None elsewhere) after consolidate_state_dict. Outside
        # `cache` (which an in-place edit seen on one rank clears): only a step, a load or
        # add_param_group, which every rank makes, drops it.
        self.consolidated = None

    def changed(self):
        self.cache.clear()

    def by_id(self, rules, kept, refresh):
        """{id(param): entry}: the whole state without a sharding; with one this rank's,
        read from its own slabs (no collective), elements owned elsewhere zero."""
        if self.shards is None:
            return self.whole(rules, kept, refresh)
        if "local_torch_state" not in self.cache:
            self.slabs.handle  # A closed optimizer refuses first.
            refresh()
            steps = self.slabs.steps()
            local = {which: self.slabs.local(which) for which in kept}
            self.cache["local_torch_state"] = local_torch_state(self.table, steps, local,
                                                                self.shards.owned, rules)
        return self.cache["local_torch_state"]

    def whole(self, rules, kept, refresh):
        """{id(param): entry} of the parameters that have been stepped (sharded: collective)."""
        if "torch_state" not in self.cache:
            steps = self.slabs.steps()
            refresh()
            full = {which: self.slabs.whole(which) for which in kept}
            layout, _ = aux_layout(self.table, rules)
            aux = (self.slabs.aux(), layout) if layout is not None else None
            self.cache["torch_state"] = torch_state(self.table, steps, full, rules, aux)
        return self.cache["torch_state"]

    def indexed(self, rules, kept, refresh):
        """{index: entry} of every stepped parameter, copies (sharded: collective)."""
        by_id = self.whole(rules, kept, refresh)
        return {i: {k: t.clone() for k, t in by_id[id(p)].items()}
                for i, p in enumerate(self.table.params) if id(p) in by_id}

    def consolidate(self, rules, kept, refresh, to):
        """The whole state, kept on rank `to` alone (collective)."""
        state = self.indexed(rules, kept, refresh)
        self.cache.pop("torch_state", None)  # Only rank `to` keeps a whole copy.
        self.consolidated = (to, state if self.shards.rank == to else None)

    def consolidated_copy(self):
        """The state consolidate_state_dict kept on this rank, a copy (RuntimeError on the
        other ranks)."""
        to, state = self.consolidated
        if state is None:
            raise RuntimeError(
                f"StagedAdamW: the state was consolidated on rank {to} "
                "(consolidate_state_dict): call state_dict() there, or local_state_dict() "
                "for this rank's shard")
        return {i: {k: t.clone() for k, t in e.items()} for i, e in state.items()}

    def _pieces(self):
        return shard_pieces(self.shards.owned if self.shards is not None else None,
                            self.table.slices)

    def _rank_world(self):
        return (self.shards.rank, self.shards.world) if self.shards is not None else (0, 1)

    def _local_of(self, full):
        return self.shards.local_of(full) if self.shards is not None else full.contiguous()

    def shard(self, rules, kept, groups):
        """local_state_dict(): this rank's shard, never collective (`groups`: param_groups as a
        state dict has them)."""
        local = {which: self.slabs.local(which) for which in kept}
        steps = self.slabs.steps()
        pieces = self._pieces()
        rank, world = self._rank_world()
        state = shard_state(steps, local, pieces, rules)
        layout, _ = aux_layout(self.table, rules)
        if layout is not None:
            shard_aux(state, layout, self.slabs.aux())
        return {"state": state, "param_groups": groups,
                "shard": {"rank": rank, "world_size": world,
                          "pieces": [[i, b, n] for i, b, n, _ in pieces],
                          "param_steps": steps}}

    def to_load(self, state_dict, rules):
        """A state dict (whole, or this rank's shard) as this rank's arrays, one per slab in
        SLABS order, and every parameter's step count; ValueError for a non-finite value."""
        state = state_dict["state"]
        aux = None  # Only optimizers without a process group keep aux state (Rule.aux).
        if state_dict.get("shard") is not None:
            rank, world = self._rank_world()
            arrays, steps = shard_arrays(state_dict["shard"], state, self.table, self._pieces(),
                                         rules, rank, world, self._local_of, self.slabs.count)
            layout, size = aux_layout(self.table, rules)
            if layout is not None:
                aux = shard_aux_array(state, self.table, layout, size)
        else:
            saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
            arrays, steps, aux = whole_arrays(self.table, saved_ids, state, rules,
                                              self._local_of)
        for name, t in list(zip(SLABS.values(), arrays)) + [("aux state", aux)]:
            if t is not None and not torch.isfinite(t).all():
                raise ValueError(f"the state dict's {name} holds a non-finite value")
        return arrays, steps, aux
