"""_StagedOptimizer: the torch.optim.Optimizer façade of ckpt's staged optimizers.

FP32 master weights and the algorithm's state live in ckpt's host slabs (not in `state`); each
`step()` hands ckpt each parameter's gradient and storage, and ckpt writes the updated weights,
rounded to the parameters' dtype, into the parameters in place. `param_groups` stay mutable as
in torch, so torch.optim.lr_scheduler schedulers work unchanged; hyper-parameters are read at
each step. Checkpoints go through ckpt.Checkpointer (transactions, async save, rollback,
resharding). The façade holds the native handle and the torch.optim contract and imports its
parts (ckpt/optim/__init__.py lists them), which never import it.
"""
import contextlib
import functools
import weakref

import torch

from .. import _lib, _signals
from .._lib import CkptError, Code
from . import state_dict as sd
from .mirror import _HostMirror
from .overlap import _GATE_WHOLE, _overlap_run
from .params import (_ParamTable, _check_kinds, _checked_params, _engine_device, _named,
                     _one_cuda, _seen_of, _stream_of)
from .rule import SLABS
from .sharding import _Sharding
from .slabs import _check_options, _Slabs
from .staging import _step_in_place, _weight_targets


def _shared(key):
    """An attribute kept in the optimizer's `_layout` dict, so that objects sharing a copy of
    its __dict__ (Lightning's wrapper) see it change (add_param_group changes these)."""
    return property(lambda self: self._layout[key],
                    lambda self, value: self._layout.__setitem__(key, value))


def _gradient_ready(ref, index, param):
    """A parameter's post-accumulate-grad hook: its gradient is final for this backward."""
    opt = ref()
    if opt is not None:
        opt._release(index, param)


class _StagedOptimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer whose state lives in one ckpt optimizer (a native handle, owned
    through a Native: wrappers that copy this object's __dict__ share it, and it is freed when
    the last of them goes, or by close()). It owns its parts: the parameter table, the host
    mirror, the overlapped step, the sharding (with a process group) and the cached torch views
    of the state; what they share with __dict__ copies is kept in mutable objects (`_layout`,
    the table, the run), never rebound. Subclasses declare an algorithm: `_rule_of(group)`,
    `_check_group_keys`, `_native_group` and `_from_native` (and, for a rule's own
    hyper-parameters, `_native_hyper` and `_from_native_hyper`). Not thread-safe: one call at a
    time, as torch's optimizers (backward's hooks take the overlapped step's lock)."""

    # The CUDA engine's least compute capability for this optimizer (StagedMuon: 8, BF16 tensor
    # cores for its products); below it, the CPU engine steps CUDA parameters.
    _min_capability = 0
    _max_slab = _shared("max_slab")  # ckpt keeps max_exp_avg_sq (some group had amsgrad).
    # The CPU engine's host copies of CUDA parameters and their gradients (None otherwise).
    _mirror = _shared("mirror")
    # Module types whose forward pre-hook waits for their whole subtree (overlap="forward").
    gate_whole = _GATE_WHOLE

    def __init__(self, params, defaults, *, moments, threads, unit_bytes, process_group,
                 bucket_elems, reduce_grads, overlap, engine):
        _check_options(moments, engine, threads, unit_bytes, bucket_elems)
        params, names = _named(params)
        self._layout = {"max_slab": False}
        super().__init__(params, defaults)
        self._native = None
        self._table = _ParamTable()
        self._params = self._table.params  # The same list, grown in place.
        self.state = sd._StateView(weakref.WeakMethod(self._state_by_id), self._params)
        plist = _checked_params(self.param_groups, self._check_group)
        cuda = _one_cuda(p.device for p in plist)
        device = _engine_device(plist, cuda, engine, self._min_capability, type(self).__name__)
        if process_group is not None and any(p.device != device for p in plist):
            raise NotImplementedError(
                "parameters on two devices with a process_group are not supported yet")
        # Each parameter keeps its own dtype; the table's dtype is theirs when they share one.
        dtype = plist[0].dtype if len({p.dtype for p in plist}) == 1 else None
        if dtype is None and process_group is not None:
            raise NotImplementedError("parameters of several dtypes with a process_group are not "
                                      "supported yet: one dtype per data-parallel optimizer")
        self._device = device
        self._mirror = _HostMirror(next(iter(cuda))) if device.type == "cpu" and cuda else None
        self._table.dtype = dtype
        # Data-parallel gradients are averaged in FP32 (gloo cannot all-reduce BF16, and a sum
        # in F16 overflows where the mean would not); ckpt's step takes FP32 gradients too.
        # With several parameter dtypes the step takes FP32 gradients (exact for each).
        self._table.grad_dtype = torch.float32 \
            if process_group is not None or dtype is None else dtype
        group_of = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        new_names, specs = self._table.describe(plist, names, [group_of[id(p)] for p in plist])
        self._table.extend(plist, new_names)
        self._group_handle = process_group
        self._shards = None
        if process_group is not None:
            whole = [rule.whole for rule, _ in self._rules()]
            self._shards = _Sharding(process_group, self._table, specs,
                                     whole if any(whole) else None, bucket_elems, device,
                                     reduce_grads)
        self._slabs = _Slabs.create(
            self._table, self._shards, specs, (_lib.Group * len(self.param_groups))(
                *[self._native_group(g) for g in self.param_groups]),
            device, moments, threads, unit_bytes)
        self._native = self._slabs.native
        for gi, g in enumerate(self.param_groups):
            try:
                self._slabs.set_hyper(gi, self._native_hyper(g))
            except BaseException:
                self.close()
                raise
        # The state as torch shapes it, made on demand and dropped by anything that changes it
        # (a step, a load); shared by objects that copy this one's __dict__.
        self._torch = sd._TorchState(self._table, self._shards, self._slabs)
        self._max_slab = any(g.get("amsgrad", False) for g in self.param_groups)
        self._start_overlap(overlap)
        self._note_versions()

    def _start_overlap(self, overlap):
        ref = weakref.ref(self)
        try:
            self._ov = _overlap_run(overlap, self._native, self._device, self._params,
                                    self._shards is not None,
                                    lambda i: functools.partial(_gradient_ready, ref, i))
        except (ValueError, NotImplementedError):
            self.close()
            raise

    def _native_hyper(self, g):
        """A group's hyper-parameters its rule keeps by name (name -> number, or None)."""
        return {}

    def _from_native_hyper(self, hyper, g):
        """After a load: those (`hyper`, as _native_hyper names them) into group `g`."""

    def _check_group(self, g, index):
        """A param group's hyper-parameters, as torch accepts them, and its implementation
        choices (ckpt's limits): ValueError naming the group's index and the key."""
        try:
            self._check_group_keys(g)
        except ValueError as e:
            raise ValueError(f"param group {index}: {e}") from None

    def _rules(self):
        """(Rule, group) of each parameter, in parameter order (which is group order)."""
        return [(self._rule_of(g), g) for g in self.param_groups for _ in g["params"]]

    def _grad_scale(self):
        """maximize, per group as torch: the gradients negated (exactly). Returns the step's
        gradient scale and the indices of the parameters whose gradients are negated one by
        one: every group alike is a scale of -1 (no copy); a mix negates the maximizing groups'
        gradients into copies."""
        signs = [bool(g.get("maximize", False)) for g in self.param_groups]
        if all(signs) or not any(signs):
            return (-1.0 if signs[0] else 1.0), frozenset()
        flip = {id(p) for g, s in zip(self.param_groups, signs) if s for p in g["params"]}
        return 1.0, frozenset(i for i, p in enumerate(self._params) if id(p) in flip)

    def _live(self):
        if self._native is None:
            raise CkptError(Code.FAILED_PRECONDITION, "the optimizer is closed")
        return self._native.handle

    def add_param_group(self, param_group):
        """torch's add_param_group, at any time: the group's parameters (tensors or (name,
        tensor) pairs) start fresh (moments zero, step count 0), the others keep their state;
        ckpt's slabs grow (both sizes are held while the state is copied). All or nothing: a
        parameter torch or ckpt refuses raises with nothing added. Refused while an async save
        is in flight, and (for now) with a process_group."""
        if getattr(self, "_native", None) is None:  # Called by torch's __init__.
            super().add_param_group(param_group)
            return
        if self._shards is not None:
            raise NotImplementedError("add_param_group with a process_group is not supported "
                                      "yet: build the optimizer with every group")
        if not isinstance(param_group, dict):
            raise TypeError("a param group is a dict")
        groups, names = _named([param_group])
        super().add_param_group(groups[0])
        try:
            self._add_to_ckpt(self.param_groups[-1], names)
        except BaseException:
            self.param_groups.pop()
            raise

    def _add_to_ckpt(self, group, names):
        """The group torch just appended, into ckpt's slabs and this object's tables."""
        gi, table = len(self.param_groups) - 1, self._table
        self._check_group(group, gi)
        new = list(group["params"])
        _check_kinds(new)
        cuda = _one_cuda(table.devices + [p.device for p in new])
        new_names, specs = table.describe(new, names, [gi] * len(new))
        self._slabs.add(new, specs, self._native_group(group))
        # ckpt has the group: a refusal of its own hyper-parameters leaves it at their defaults
        # (and the caller sees the error, as from any later step).
        self._slabs.set_hyper(gi, self._native_hyper(group))
        # ckpt has them: the tables follow, in place (shared with __dict__ copies).
        self._max_slab = self._max_slab or bool(group.get("amsgrad", False))
        table.extend(new, new_names)
        if self._mirror is None and self._device.type == "cpu" and cuda:
            self._mirror = _HostMirror(next(iter(cuda)))
        self._torch.consolidated = None
        if table.dtype is not None and any(p.dtype != table.dtype for p in new):
            table.dtype, table.grad_dtype = None, torch.float32
        self._state_changed()

    def zero_grad(self, set_to_none=None):
        """torch's zero_grad (set_to_none: torch's default when not given). An overlapped step
        still open (its step() was skipped, as GradScaler skips a step whose gradients
        overflowed) is abandoned first: the weights it wrote during backward go back to the
        masters before the next forward reads them."""
        run = getattr(self, "_ov", None)
        if run is not None:
            if run.native is not None:
                run.drop(self._mirror)
            run.failed = False
            if set_to_none is False:  # Zeroed in place: after the step's kernels read them.
                self.wait_for_step()
        if set_to_none is None:
            super().zero_grad()
        else:
            super().zero_grad(set_to_none=set_to_none)

    @contextlib.contextmanager
    def accumulating(self):
        """Backward inside this block releases nothing to an overlapped step: wrap every
        micro-batch of a gradient accumulation but the last (its gradients are not final, and
        the next micro-batch's forward must see the weights as they are)."""
        self._ov.depth += 1
        try:
            yield
        finally:
            self._ov.depth -= 1

    @torch.no_grad()
    def clip_grad_norm(self, max_norm, norm_type=2.0):
        """torch.nn.utils.clip_grad_norm_ over this optimizer's parameters, applied by the next
        step() as a factor of its gradient scale instead of in place: the gradients are left as
        they are, so an overlapped step's speculation holds whenever clipping does not fire.
        Returns the total norm (a tensor, as torch). The norm of each gradient is taken in FP32,
        then the norm of those norms; the coefficient is max_norm / (norm + 1e-6), at most 1.
        A non-finite norm leaves the gradients unscaled (torch would make every one NaN)."""
        return self._ov.clip([p.grad for p in self._params if p.grad is not None], max_norm,
                             norm_type)

    def _release(self, index, p):
        """The post-accumulate-grad hook's work (overlap.py: _OverlapRun.release)."""
        self._ov.release(index, p, self._mirror, self._table.grad_dtype, self._begin_overlap)

    def _begin_overlap(self):
        """Opens the overlapped step at backward's first hook. False when it cannot (this
        step runs plainly)."""
        scale, flip = self._grad_scale()
        if flip:
            self._ov.failed = True
            return False
        handle = self._push_groups()  # Hyper-parameters and edited parameters, first.
        return self._ov.begin(handle, scale, self._table, self._mirror)

    def _drain_overlap(self):
        """Waits until ckpt has updated every parameter released so far (tests: the step
        then finds them all speculated)."""
        self._ov.drain(self._mirror)

    def wait_for_step(self):
        """After a step of overlap="forward": what the current stream runs next sees every
        parameter this step wrote (the forward's own modules wait for theirs by themselves).
        Call it before reading parameters outside their module's forward (an EMA update, a
        weight read elsewhere, a save of the model) ahead of the next forward; before code that
        zeroes or writes gradients in place other than this optimizer's zero_grad; and before
        capturing a CUDA graph. A no-op otherwise."""
        run = getattr(self, "_ov", None)
        if run is not None:
            run.wait_for_step(self._mirror)

    @property
    def last_overlap(self):
        """(units updated during backward, whether that speculation held) of the last overlapped
        step, or None when the last step ran plainly."""
        return self._ov.last

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        run = self._ov
        coef = run.take_coef()
        run.failed = False
        run.last = None
        self.wait_for_step()  # The last step's gate, if no forward ran since.
        if run.native is not None:
            scale, flip = self._grad_scale()
            if run.finish(coef, scale, flip, self._table, self._mirror, self._set_groups,
                          self._new_state, self.gate_whole):
                return loss
        if run.enabled and run.native is None:
            run.speculate = coef == 1.0 and not run.in_place
        # As torch: a parameter whose .grad is None is not stepped (nor decayed), and its own
        # step count does not advance; a step in which none has a gradient changes nothing.
        grad_of = [p.grad for p in self._params]
        stepped = [g is not None for g in grad_of]
        if self._shards is not None:
            self._shards.step(self._prepare_step, stepped, coef, self._new_state)
        else:
            self._step_local(grad_of, stepped, coef)
        return loss

    def _step_local(self, grad_of, stepped, coef):
        """One process: every gradient read and every parameter written in place, in one
        call (staging.py)."""
        if not any(stepped):
            self._refresh_edited()  # Nothing steps, but an edit is seen now, not later.
            return
        handle, scale, flip = self._prepare_step()
        scale *= coef
        self._new_state()
        _step_in_place(handle, self._table, grad_of, stepped, self._device, scale, flip,
                       self._mirror, self._ov, self.gate_whole)

    def _prepare_step(self):
        """Hyper-parameters and edited parameters into ckpt (checking them), before a step.
        Returns (handle, the gradient scale, the indices of gradients negated one by one)."""
        handle = self._push_groups()
        scale, flip = self._grad_scale()
        return handle, scale, flip

    def _any_rank(self, flag):
        """Data parallel: whether `flag` holds on any rank (collective)."""
        return self._shards.any_rank(flag)

    def _state_changed(self):
        """The state changes (a step, a load, edited parameters taken in, a group added):
        cached views of it go, and the generation moves, so that what a Checkpointer or an
        integration remembers the state equalled no longer holds."""
        self._torch.changed()
        self._layout["generation"] = self._layout.get("generation", 0) + 1

    def _new_state(self):
        """A step or a load replaces the state on every rank: as _state_changed, and a state
        consolidated on one rank (consolidate_state_dict) goes too."""
        self._state_changed()
        self._torch.consolidated = None

    def _generation(self):
        """A value that stays the same exactly while the state does: what ckpt holds (moved by
        _state_changed) and what each parameter is (an edit is taken in at the next step)."""
        return self._layout.get("generation", 0), tuple(_seen_of(p) for p in self._params)

    def _note_versions(self):
        """What each parameter is now, so that the next step can tell which ones the trainer
        changed in place (in place: objects that copy this one's __dict__ share the table)."""
        self._table.note_versions()

    def _refresh_edited(self):
        """A parameter changed since ckpt last wrote it (model.load_state_dict, p.mul_() under
        no_grad, re-initialisation, an EMA swap: anything that bumps its version counter or
        replaces its storage) becomes its own master before the step, as torch AdamW would
        continue from the edited value: the master takes the parameter's value widened to FP32
        (for a BF16 or FP16 parameter, the low bits the master had beyond the parameter's
        precision are gone). Moments and step counts stay."""
        table = self._table
        now, edited = table.edited()
        if not edited:
            return
        self._live()
        self._state_changed()
        for i in edited:
            values = table.params[i].detach().reshape(-1).float().cpu()
            if not torch.isfinite(values).all():
                raise ValueError(f"parameter {table.names[i]} was set to a non-finite value")
            self._slabs.set_masters(i, values)
        table.seen[:] = now

    def _set_groups(self):
        """param_groups' hyper-parameters, checked, into ckpt. Returns the handle."""
        handle = self._live()
        for gi, g in enumerate(self.param_groups):
            self._check_group(g, gi)
            self._slabs.set_group(gi, self._native_group(g))
            self._slabs.set_hyper(gi, self._native_hyper(g))
        return handle

    def _push_groups(self):
        """param_groups' hyper-parameters into ckpt: before every step, and before a save (so
        the checkpoint holds what the next step will use, e.g. after a scheduler's step)."""
        handle = self._set_groups()
        self._refresh_edited()  # A save holds the parameters as the trainer left them.
        return handle

    def _pull_groups(self):
        """After a load: the checkpoint's hyper-parameters into param_groups."""
        for gi, g in enumerate(self.param_groups):
            self._from_native(self._slabs.group(gi), g)
            self._from_native_hyper({name: self._slabs.get_hyper(gi, name)
                                     for name in self._native_hyper(g)}, g)

    def _of(self, p, which):
        """Parameter p's slice of one state tensor, as a tensor of its own: only p's elements
        are read (data-parallel: gathered from the ranks that own them, so every rank must
        call it), so reading every parameter's state one by one costs one read of the state."""
        index = self._table.index(p)
        self._live()
        self._refresh_edited()
        return self._slabs.param(index, which).view(p.shape)

    def master(self, p):
        """The FP32 master weights of parameter `p` (a copy)."""
        return self._of(p, _lib.MASTER)

    def group_steps(self):
        """Each param group's step counter, as ckpt keeps it."""
        return [self._slabs.group(gi).step for gi in range(len(self.param_groups))]

    def param_steps(self):
        """Each parameter's step count (how many steps updated it), in parameter order."""
        return self._slabs.steps()

    @property
    def lifecycle(self):
        return self._slabs.lifecycle()

    def _publish_weights(self):
        """After a load (which changes ckpt's masters only): the parameters become the masters
        rounded to their dtype, written in place (data-parallel: collective, the ranks exchange
        their pieces)."""
        self._live()
        self.wait_for_step()  # A gated step's writes come first.
        self._new_state()
        if self._shards is not None:
            self._slabs.publish_shards()
            return
        # Into each parameter's own storage (non-contiguous ones through a copy); CUDA
        # parameters rounded on the device, ordered on the current stream.
        ptrs, staged = _weight_targets(self._table, self._device)
        self._slabs.write_weights(ptrs, self._device, _stream_of(self._device))
        with torch.no_grad():
            for p, c in staged:
                p.detach().copy_(c)
        self._note_versions()

    def _kept(self):
        """The slabs ckpt keeps: max_exp_avg_sq once some group had amsgrad."""
        return [which for which in SLABS if which != _lib.MAX_EXP_AVG_SQ or self._max_slab]

    def _state_by_id(self):
        """What `state` shows: the whole state, or with a process group this rank's
        (state_dict.py: _TorchState.by_id)."""
        return self._torch.by_id(self._rules(), self._kept(), self._refresh_edited)

    def _indexed_groups(self):
        return sd.indexed_groups(self.param_groups)

    def state_dict(self):
        """torch.optim.AdamW's format: {"state": {index: {"step", "exp_avg", "exp_avg_sq",
        "master"}}, "param_groups": [{hyper-parameters, "params": [indices]}]}, CPU tensors in
        each parameter's shape (FP32; "master" is ckpt's FP32 master weights, which torch AdamW
        ignores). Parameters are numbered in group order, as torch numbers them; one that has
        not been stepped has no entry. torch.optim.AdamW.load_state_dict takes it.

        With a process group, as torch's sharded optimizers (ZeroRedundancyOptimizer): after
        consolidate_state_dict(to) on every rank, state_dict() on rank `to` returns the whole
        state without any collective (until the next step or load), and raises on the other
        ranks; otherwise it is collective (every rank must call it) and every rank gets the
        whole state. local_state_dict() is this rank's shard alone.

        With a trainer integration attached (ckpt.integrations: the state kept in a ckpt
        store), it is a reference instead, {"ckpt": {"root", "step"}, "param_groups"}, that the
        integration saves and load_state_dict() resolves."""
        store = self._layout.get("state_store")
        if store is not None:
            return store.state_dict_reference(self)
        if self._shards is not None and self._torch.consolidated is not None:
            return {"state": self._torch.consolidated_copy(),
                    "param_groups": self._indexed_groups()}
        self._push_groups()
        return {"state": self._torch.indexed(self._rules(), self._kept(), self._refresh_edited),
                "param_groups": self._indexed_groups()}

    def consolidate_state_dict(self, to=0):
        """torch ZeroRedundancyOptimizer's convention (Lightning calls it before saving):
        collective; rank `to` of the process group then holds the whole state, which its
        state_dict() returns without a collective until the next step or load. Without a
        process group it does nothing (every state_dict() is whole)."""
        if self._shards is None or self._layout.get("state_store") is not None:
            return  # Whole already, or a reference (a trainer integration's): nothing to gather.
        self._push_groups()
        self._torch.consolidate(self._rules(), self._kept(), self._refresh_edited, to)

    def local_state_dict(self):
        """This rank's shard, never collective: {"state": {index: {"step", "exp_avg",
        "exp_avg_sq", ["max_exp_avg_sq",] "master"}}, "param_groups": [...], "shard": {"rank",
        "world_size", "pieces": [[index, begin, count], ...], "param_steps": [...]}}, where each
        tensor is 1-D: the elements of that parameter this rank owns (its pieces, in order).
        load_state_dict() takes each rank's own shard back (all ranks at once: the weights are
        then exchanged). Without a process group the shard is the whole state, flat."""
        self._push_groups()
        return self._torch.shard(self._rules(), self._kept(), self._indexed_groups())

    def load_state_dict(self, state_dict):
        """Loads a state dict of this optimizer's format or torch's (torch.optim.AdamW's; for
        StagedMuon's Muon groups torch.optim.Muon's), all or nothing: the hyper-parameters, the
        state and step counters, and the masters ("master" when the dict has it, else the
        parameters' values widened to FP32); the parameters then become the masters rounded. A
        parameter without an entry starts fresh (state zero, step 0). Raises ValueError naming
        what does not fit (groups, sizes, a non-finite value, a step that is not a count) with
        nothing changed.
        With a process group it is collective: every rank passes the whole dict, or each rank
        its own shard (local_state_dict()); a shard of another rank or layout is refused by
        every rank before anything changes."""
        self._live()
        if isinstance(state_dict, dict) and isinstance(state_dict.get("ckpt"), dict):
            # A reference to a step of a ckpt store (a trainer integration's state_dict()).
            store = self._layout.get("state_store")
            ref = state_dict["ckpt"]
            if store is None:
                raise ValueError(f"this state dict refers to step {ref.get('step')} of the ckpt "
                                 f"store {ref.get('root')}: attach the ckpt integration that "
                                 "saved it (ckpt.integrations) to load it")
            store.load_reference(self, state_dict)
            return
        error = None
        try:
            new_groups, arrays, steps, aux = self._to_load(state_dict)
        except Exception as e:  # Any refusal, on any rank, is every rank's (see below).
            error = e
        # Every rank refuses if any does: a rank that went on would wait forever for the others
        # in the weight exchange.
        if self._shards is not None and self._any_rank(error is not None) and error is None:
            error = ValueError("another rank refused the state dict (its error names why); "
                               "nothing was loaded")
        if error is not None:
            raise error
        with _signals.deferred():
            # The state first: it is what can still be refused (an async save in flight); the
            # groups, validated above, then cannot be.
            self._slabs.set_state(arrays, steps, self._max_slab, aux)
            self._state_changed()
            for gi, (ours, group) in enumerate(zip(self.param_groups, new_groups)):
                ours.update({k: val for k, val in group.items() if k != "params"})
                self._slabs.set_group(gi, self._native_group(ours))
                self._slabs.set_hyper(gi, self._native_hyper(ours))
            self._publish_weights()

    def _to_load(self, state_dict):
        """What load_state_dict loads: (the merged param groups, this rank's arrays, the step
        counts), or the reason it refuses (raised)."""
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        state = state_dict.get("state") if isinstance(state_dict, dict) else None
        if not isinstance(groups, (list, tuple)) or not isinstance(state, dict):
            raise ValueError('a state dict has "state" (a dict) and "param_groups" (a list)')
        # What ckpt would refuse after the vote, checked before it (every rank alike).
        if self.lifecycle != "clean":
            raise CkptError(Code.FAILED_PRECONDITION,
                            f"load_state_dict: the optimizer is {self.lifecycle}")
        if any(ck.pending is not None for ck in self._layout.get("checkpointers", ())):
            raise CkptError(Code.FAILED_PRECONDITION,
                            "load_state_dict: an async save is in flight (its writer "
                            "reads the state): finalize it first")
        new_groups = self._merged_groups(groups)
        return (new_groups, *self._torch.to_load(state_dict, self._rules()))

    def _take_hyper_parameters(self, groups):
        """A state dict's param_groups (their hyper-parameters, validated as load_state_dict
        validates them) into param_groups; ckpt takes them at the next step."""
        if groups is None:
            return
        for ours, group in zip(self.param_groups, self._merged_groups(groups)):
            ours.update({k: v for k, v in group.items() if k != "params"})

    def _merged_groups(self, groups):
        """This optimizer's param groups with a state dict's hyper-parameters, validated."""
        return sd.merged_groups(self.param_groups, groups, self._check_group, self._max_slab)

    def close(self):
        """Frees ckpt's slabs (closing its checkpointers first: an async save in flight is
        abandoned); the optimizer refuses every call afterwards. Closing twice is harmless.
        Without close(), the slabs are freed when the last reference to the optimizer (or to
        a wrapper sharing its attributes) goes."""
        with _signals.deferred():
            run = getattr(self, "_ov", None)
            try:
                if run is not None:
                    run.close(self._mirror)
            finally:
                if self._native is not None:
                    self._native.close()

    def __deepcopy__(self, memo):
        raise TypeError("ckpt.torch.StagedAdamW keeps its state in native memory and cannot be "
                        "deep-copied; save it with ckpt.Checkpointer or state_dict()")

    def __reduce_ex__(self, protocol):
        raise TypeError("ckpt.torch.StagedAdamW keeps its state in native memory and cannot be "
                        "pickled; pickle its state_dict() instead")
