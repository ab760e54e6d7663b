"""The step hidden behind backward (overlap=True) and behind the next forward
(overlap="forward"): each parameter's gradient-ready hook releases it to an open ckpt_overlap,
which updates its units while backward goes on; step() finishes it as the plain step would run,
bit for bit, or abandons it (docs/design/overlap.md, docs/python.md). With overlap="forward"
what is left of the step when backward ends is written in parameter order, and a global module
forward pre-hook (the gate) makes each module's next forward wait only for its own parameters.
"""
import ctypes
import functools
import threading
import warnings
import weakref

import torch

from .._lib import CkptError, check, lib
from .._native import Native
from .mirror import _current_stream_id
from .params import _DTYPES, _stream_of

# Modules whose forward reads their children's weights without calling the children
# (MultiheadAttention reads out_proj's; DataParallel copies every parameter): a gated step's
# forward pre-hook waits for their whole subtree. Add your own to StagedAdamW.gate_whole.
_GATE_WHOLE = (torch.nn.MultiheadAttention, torch.nn.DataParallel,
               torch.nn.parallel.DistributedDataParallel)


def _gate_forward(ref, module, args):
    """A module's forward is about to read its parameters: the stream waits for the gated
    step's writes of theirs (overlap="forward")."""
    run = ref()
    if run is None or not run.gated:
        return
    if isinstance(module, run.whole):
        _await_params(run, module.parameters())
    elif module._parameters:
        _await_params(run, module._parameters.values())


def _await_params(run, params):
    """The current stream waits for the gated step's writes of these parameters' weights (those
    still gated); their gradients are then let go."""
    index_of, gated = run.index_of, run.gated
    indices = [i for i in (index_of.get(id(p)) for p in params if p is not None)
               if i is not None and i in gated]
    if not indices:
        return
    if run.by_events:  # The host mirror's copies back, each with its event.
        stream = torch.cuda.current_stream(run.device)
        for i in indices:
            stream.wait_event(gated.pop(i))
        if not gated:
            _drop_gate_hook(run)
        return
    native = run.optimizer
    if native is None or native.closed:
        run.gated = {}
        _drop_gate_hook(run)
        return
    check(lib.ckpt_optimizer_await_pieces(
        native.handle, (ctypes.c_uint32 * len(indices))(*indices), len(indices),
        torch.cuda.current_stream(run.device).cuda_stream))
    for i in indices:
        del gated[i]  # Freed on the stream that waited: after the step's reads.
    if not gated:
        _drop_gate_hook(run)


def _drop_gate_hook(run):
    """Nothing is gated any more: the global forward pre-hook goes (every module call of the
    process runs torch's slower hooked path while one is registered); the next gate adds it."""
    if run.gate_hook is not None:
        run.gate_hook.remove()
        run.gate_hook = None


def _overlap_run(overlap, optimizer, engine, params, sharded, hook):
    """The _OverlapRun for a constructor's `overlap` argument, over the optimizer's Native and
    its engine's device, with `hook(index)` registered as each parameter's post-accumulate-grad
    hook when it overlaps. ValueError or NotImplementedError when it cannot (the caller then
    closes the optimizer)."""
    if overlap not in (False, True, "forward"):
        raise ValueError(f"overlap must be False, True or \"forward\", not {overlap!r}")
    run = _OverlapRun(bool(overlap), overlap == "forward", optimizer, engine)
    if not overlap:
        return run
    if not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
        raise NotImplementedError(
            f"overlap=True needs post-accumulate-grad hooks (torch >= 2.1); this is "
            f"torch {torch.__version__}")
    if sharded:
        raise NotImplementedError("overlap=True with a process_group is not supported yet")
    run.hooks = [p.register_post_accumulate_grad_hook(hook(i)) for i, p in enumerate(params)]
    return run


class _OverlapRun:
    """The overlapped step of one optimizer, which owns it: the open ckpt_overlap (a Native
    child of the optimizer's), each released parameter's gradient version, the step's clipping
    coefficient, and the gate of overlap="forward". One object shared by wrappers that copy the
    optimizer's __dict__; what its hooks need (the optimizer's Native, its engine's device) is
    kept here, and what changes with the optimizer's parameters (the parameter table, the host
    mirror, the gradient dtype) is passed to each call. Backward's hooks run on its calling
    thread and on the device's autograd thread, at the same time when one step mixes CPU and
    CUDA parameters: they hold `lock`; the optimizer's own calls run between backwards."""

    def __init__(self, enabled, gate, optimizer, engine):
        self.enabled = enabled
        self.gate = gate  # overlap="forward": the next forward waits layer by layer.
        # A gated step's parameters whose weights no forward has waited for yet: index -> its
        # gradient, alive until then (the step's kernels may still read it).
        self.gated = {}
        # What `gated` maps to: False, each parameter's gradient (the CUDA engine's gate, which
        # ckpt awaits); True, the event after its weight's copy back (the CPU engine's host
        # mirror, which the stream waits for).
        self.by_events = False
        self.gate_hook = None  # The global module forward pre-hook, once a gate opened.
        # What the hooks need, here rather than on the optimizer (wrappers copy its __dict__):
        # the optimizer's Native, the engine's device, the gate's device, and id(parameter) ->
        # index.
        self.optimizer = optimizer
        self.engine = engine
        self.device = None
        self.index_of = {}
        self.whole = ()  # StagedAdamW.gate_whole, as the gate opened.
        self.native = None
        # Parameter index -> (its gradient, the gradient's _version) when released: a gradient
        # replaced since (p.grad = ...) or changed in place is seen at step().
        self.released = {}
        self.failed = False  # This backward cannot overlap: the step runs plainly.
        self.depth = 0  # Open accumulating() blocks.
        self.coef = None  # clip_grad_norm's coefficient (a tensor), for the next step.
        # The released parameters and gradients, alive until the step ends: ckpt reads them
        # after Release (the CPU engine's feeder thread, the CUDA engine's queued kernels).
        self.keep = []
        self.stream = None  # The CUDA stream the overlap began on.
        self.last = None  # (units speculated, speculation held) of the last overlapped step.
        # Whether the next step overlaps: not after a step whose speculation could not have
        # held (clipping fired, gradients changed in place), so that a run where clipping
        # fires every step pays nothing for it (its hooks return at once and the step runs
        # plainly); again after a plain step whose clipping did not fire, unless the last
        # overlapped step found its gradients changed in place (torch's clip_grad_norm_).
        self.speculate = True
        self.in_place = False
        self.hooks = []
        # Parameter index -> its ckpt_overlap_release arguments (index, gradient, weight),
        # made at its first hook and refilled at the next ones.
        self.args = {}
        # Held by each hook and by abandoning: the hooks of CPU parameters run on backward's
        # calling thread and those of CUDA parameters on the device's autograd thread, at the
        # same time when one step mixes them (the CPU engine's host mirror).
        self.lock = threading.RLock()

    def clip(self, grads, max_norm, norm_type):
        """clip_grad_norm over these gradients: the total norm, and its coefficient kept for the
        next step (optimizer.py: _StagedOptimizer.clip_grad_norm)."""
        if not grads:
            self.coef = None
            return torch.tensor(0.0)
        norm_type = float(norm_type)
        device = grads[0].device
        norms = [torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float32).to(device)
                 for g in grads]
        total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        self.coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        return total

    def take_coef(self):
        """The clipping coefficient for this step (1.0 without clip_grad_norm), as a float."""
        coef, self.coef = self.coef, None
        if coef is None:
            return 1.0
        value = float(coef.item())
        return value if value == value and value not in (float("inf"), float("-inf")) else 1.0

    def overlappable(self, p, g, mirror, grad_dtype):
        """Whether an overlapped step can take this gradient: where ckpt reads it (and writes
        the parameter), or (the CPU engine's CUDA parameters) through the host mirror."""
        if mirror is not None and p.is_cuda:
            return mirror.takes(p, g, grad_dtype)
        return (g.dtype is grad_dtype and g.is_contiguous() and g.device == self.engine
                and p.device == self.engine and p.is_contiguous())

    def release(self, index, p, mirror, grad_dtype, begin):
        """A post-accumulate-grad hook's work: parameter `index`'s gradient is final. Runs on
        backward's thread at every parameter, whose host time a host-bound backward waits for:
        the ctypes arguments of each parameter are made once and refilled. `begin()` opens the
        overlapped step at the first hook (False: this step runs plainly)."""
        with self.lock:
            self._release_locked(index, p, mirror, grad_dtype, begin)

    def _release_locked(self, index, p, mirror, grad_dtype, begin):
        if (not self.enabled or not self.speculate or self.depth > 0 or self.failed or
                self.optimizer.closed):
            return  # This step runs plainly.
        g = p.grad
        if g is None or not self.overlappable(p, g, mirror, grad_dtype):
            self.drop(mirror)
            self.failed = True
            return
        if self.native is None and not begin():
            return
        if mirror is not None and p.is_cuda:
            # CPU engine: out to the host first; ckpt gets the gradients whose copies landed.
            mirror.copy_out(index, g)
            self.keep.append((p, g))
            twice = index in self.released  # ckpt refuses it (undeclared accumulation): now.
            self.released[index] = (g, g._version)
            self.hand_over(mirror.flush() if twice else mirror.landed(), mirror)
            return
        if self.stream is not None and _current_stream_id(self.stream) != self.stream.stream_id:
            # This gradient was made on another stream.
            self.stream.wait_stream(torch.cuda.current_stream(self.engine))
        self.keep.append((p, g))
        args = self.args.get(index)
        if args is None:
            args = self.args[index] = ((ctypes.c_uint32 * 1)(index), (ctypes.c_void_p * 1)(),
                                       (ctypes.c_void_p * 1)())
        args[1][0], args[2][0] = g.data_ptr(), p.data_ptr()
        try:
            check(lib.ckpt_overlap_release(self.native.handle, args[0], args[1], args[2], 1))
        except CkptError:
            self.drop(mirror)  # Abandoned by ckpt: the weights are the masters again.
            raise
        self.released[index] = (g, g._version)

    def begin(self, handle, scale, table, mirror):
        """Opens the overlapped step at backward's first hook, on the optimizer `handle` (its
        hyper-parameters and edited parameters pushed) with the step's gradient `scale`. False
        when it cannot (this step and the next ones run plainly)."""
        out = ctypes.c_void_p()
        self.stream = torch.cuda.current_stream(self.engine) \
            if self.engine.type == "cuda" else None
        self.wait_for_step(mirror)  # The last step's gate, if a forward left it open.
        if mirror is not None:
            mirror.fit(table.params, table.grad_dtype)
            mirror.flush()
            mirror.wait_written()  # ckpt writes the weights' buffer from now on.
        dtype = _DTYPES[table.grad_dtype]
        try:
            if self.gate and self.stream is not None:
                check(lib.ckpt_overlap_begin_gated(handle, dtype, scale, self.stream.cuda_stream,
                                                   0, ctypes.byref(out)))
            else:  # Speculate: a step that would not, runs plainly.
                check(lib.ckpt_overlap_begin(
                    handle, dtype, scale,
                    self.stream.cuda_stream if self.stream is not None else None, 1,
                    ctypes.byref(out)))
        except CkptError as e:
            # E.g. no host memory for the spare side: this step and the next ones run
            # plainly.
            warnings.warn(f"ckpt: the overlapped step could not begin ({e}); stepping "
                          "plainly from now on")
            self.failed, self.enabled = True, False
            return False
        self.native = Native(out, lib.ckpt_overlap_destroy, "overlapped step",
                             parents=(self.optimizer,))
        return True

    def hand_over(self, indices, mirror):
        """The CPU engine's CUDA parameters whose gradients have reached the host mirror, to
        ckpt (which updates their units on its feeder thread, writing the mirror's weights)."""
        if not indices:
            return
        k = len(indices)
        try:
            check(lib.ckpt_overlap_release(
                self.native.handle, (ctypes.c_uint32 * k)(*indices),
                (ctypes.c_void_p * k)(*[mirror.grad_ptr[i] for i in indices]),
                (ctypes.c_void_p * k)(*[mirror.weight_ptr[i] for i in indices]), k))
        except CkptError:
            self.drop(mirror)  # Abandoned by ckpt: the CUDA weights were never written.
            raise

    def drain(self, mirror):
        """Waits until ckpt has updated every parameter released so far (tests: the step
        then finds them all speculated)."""
        if self.native is not None:
            if mirror is not None:
                self.hand_over(mirror.flush(), mirror)
            check(lib.ckpt_overlap_drain(self.native.handle))

    def drop(self, mirror):
        """Abandons the open overlapped step, if any: the state stays as before the step and
        the weights it wrote are rewritten from the masters."""
        with self.lock:
            native, self.native, self.released = self.native, None, {}
            if mirror is not None:
                mirror.flush()  # Before the gradients the copies read can go.
            if native is not None:
                native.close()
            self.keep = []

    def finish(self, coef, scale, flip, table, mirror, set_groups, new_state, whole):
        """Ends the open overlapped step as the plain step would run, with the step's clipping
        `coef` and gradient `scale` (`flip`: the parameters whose gradients a maximize mix
        negates). `set_groups()` hands ckpt the hyper-parameters (a scheduler may have run
        since), `new_state()` drops what described the state before it. False when it cannot
        (a gradient ckpt would have to convert, a maximize mix, nothing to step): the overlap is
        abandoned and the plain step runs."""
        native, released = self.native, self.released
        self.native, self.released = None, {}
        keep, self.keep = self.keep, []  # Alive until the overlap is closed (finally).
        try:
            grad_of = [p.grad for p in table.params]
            stepped = [g is not None for g in grad_of]
            if (not any(stepped) or flip or
                    not all(self.overlappable(p, g, mirror, table.grad_dtype)
                            for p, g in zip(table.params, grad_of) if g is not None)):
                return False
            set_groups()
            changed = any(grad_of[i] is not g or g._version != v
                          for i, (g, v) in released.items())
            if changed:
                check(lib.ckpt_overlap_invalidate(native.handle))  # Changed in place since.
            self.speculate = coef == 1.0 and not changed
            self.in_place = changed
            new_state()
            grads, params, mirrored = self._pointers(native, grad_of, table, mirror, released,
                                                     changed)
            n = len(table.params)
            skipped, held = ctypes.c_int(0), ctypes.c_int(0)
            speculated = ctypes.c_uint64(0)
            check(lib.ckpt_overlap_finish(
                native.handle, (ctypes.c_void_p * n)(*grads), (ctypes.c_void_p * n)(*params),
                n, (ctypes.c_uint8 * n)(*stepped), n, _DTYPES[table.grad_dtype], scale * coef,
                0, _stream_of(self.engine), ctypes.byref(skipped), ctypes.byref(speculated),
                ctypes.byref(held)))
            self.last = (speculated.value, bool(held.value))
            if mirrored and not skipped.value:
                self.gate_mirror(mirror.copy_in(table.params, mirrored, table.seen,
                                                gated=self.gate), mirror.device, table, whole)
            elif held.value and self.gate:
                self.open_gate(grad_of, table, whole)
            return True
        finally:
            native.close()
            if mirror is not None:
                mirror.flush()  # Copies still queued read gradients `keep` holds.
            del keep

    @staticmethod
    def _pointers(native, grad_of, table, mirror, released, changed):
        """Where the finishing step reads each gradient and writes each parameter: in place,
        or (the CPU engine's CUDA parameters) the host mirror. Returns (gradient pointers,
        parameter pointers, the indices stepped through the mirror)."""
        grads = [g.data_ptr() if g is not None else None for g in grad_of]
        params = [p.data_ptr() if g is not None else None
                  for p, g in zip(table.params, grad_of)]
        mirrored = []
        if mirror is None:
            return grads, params, mirrored
        # Every copy queued has landed; those ckpt was not handed yet are stepped by Finish
        # like any unit not speculated. A gradient without a copy (no hook ran for it) or
        # changed since its copy is copied now.
        mirror.flush()
        if changed:  # Its feeder reads no mirror gradient while they are copied again.
            check(lib.ckpt_overlap_drain(native.handle))
        late = False
        for i, g in enumerate(grad_of):
            if g is None or not table.params[i].is_cuda:
                continue
            mirrored.append(i)
            grads[i], params[i] = mirror.grad_ptr[i], mirror.weight_ptr[i]
            if changed or i not in released:
                mirror.grads[i].copy_(g.view(-1), non_blocking=True)
                late = True
        if late:
            torch.cuda.current_stream(mirror.device).synchronize()
        return grads, params, mirrored

    def open_gate(self, grad_of, table, whole):
        """After a gated step held: each stepped parameter waits for its module's forward (or
        wait_for_step), its gradient kept alive until then."""
        is_open = ctypes.c_int(0)
        check(lib.ckpt_optimizer_gate_open(self.optimizer.handle, ctypes.byref(is_open)))
        if not is_open.value:
            return
        self._gate_on({i: g for i, g in enumerate(grad_of) if g is not None}, False,
                      self.engine, table, whole)

    def gate_mirror(self, after, device, table, whole):
        """After the host mirror's gated copies back (overlap="forward" on the CPU engine):
        each parameter waits for its copy's event at its module's forward (or wait_for_step)."""
        if after:
            self._gate_on(after, True, device, table, whole)

    def _gate_on(self, gated, by_events, device, table, whole):
        self.gated, self.by_events = gated, by_events
        self.device, self.whole = device, tuple(whole)
        if len(self.index_of) != len(table.params):  # add_param_group added some.
            self.index_of = {id(p): i for i, p in enumerate(table.params)}
        if self.gate_hook is None:
            self.gate_hook = torch.nn.modules.module.register_module_forward_pre_hook(
                functools.partial(_gate_forward, weakref.ref(self)))

    def wait_for_step(self, mirror):
        """The current stream waits for every write of the gated step, if one is open; the
        gate then closes."""
        if not self.gated:
            return
        if self.by_events:  # The host mirror's copies back: the event after the last one.
            torch.cuda.current_stream(self.device).wait_event(mirror.written)
        elif not self.optimizer.closed:
            check(lib.ckpt_optimizer_await_step(self.optimizer.handle, _stream_of(self.engine)))
        self.gated = {}  # Freed after the wait: on the stream that waited.
        _drop_gate_hook(self)

    def close(self, mirror):
        """The optimizer closes: the gate is waited for and closed, and an open overlapped step
        abandoned (its queued copies read gradients it holds)."""
        try:
            self.wait_for_step(mirror)  # A no-op without an open gate or once closed.
        finally:
            self.gated = {}
            _drop_gate_hook(self)
            if self.native is not None:
                self.drop(mirror)
