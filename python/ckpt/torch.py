"""ckpt.torch.StagedAdamW: ckpt's AdamW as a torch.optim.Optimizer.

FP32 master weights and both moments live in ckpt's host slabs (not in `state`); each `step()`
hands ckpt each parameter's gradient and storage (the CPU engine on every core, or the CUDA
engine streaming units through bounded GPU buffers on the current stream), which writes the
updated weights, rounded to the parameters' dtype, into the parameters in place. `param_groups` stay mutable as in
torch, so torch.optim.lr_scheduler schedulers work unchanged; hyper-parameters are read at each
step. Checkpoints go through ckpt.Checkpointer (transactions, async save, rollback, resharding).
"""
import bisect
import collections
import contextlib
import ctypes
import functools
import threading
import warnings
import weakref

import torch

from . import _lib, _signals
from ._lib import CkptError, Code, check, lib
from ._native import Native

_DTYPES = {torch.float32: _lib.F32, torch.bfloat16: _lib.BF16, torch.float16: _lib.F16}
_MOMENTS = {"f32": _lib.MOMENTS_F32, "bf16": _lib.MOMENTS_BF16}
# torch.optim.Muon's adjust_lr_fn values (None is "original").
_MUON_LR = {None: _lib.MUON_LR_ORIGINAL, "original": _lib.MUON_LR_ORIGINAL,
            "match_rms_adamw": _lib.MUON_LR_MATCH_RMS_ADAMW}


def _torch_adamw_defaults():
    """The keyword arguments of this torch's AdamW with their defaults, as its param_groups and
    state dicts carry them (they differ between torch versions)."""
    keys = torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).defaults
    return {k: v for k, v in keys.items() if k not in ("lr", "betas", "eps", "weight_decay")}


def _seen_of(p):
    """What ckpt remembers of a parameter it wrote, to tell an edit by the trainer at the next
    step: its version counter, storage and shape (`.data` set to a view of it changes neither
    of the others)."""
    return p._version, p.data_ptr(), p.shape


def _is_number(value):
    """An int or float (not a bool), or a one-element tensor (torch accepts a tensor lr)."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and value.is_floating_point()
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_implementation_choices(options):
    """torch AdamW's keyword arguments: those that only choose torch's implementation are
    accepted at any value; differentiable only at its default."""
    if options.get("differentiable"):
        raise NotImplementedError("StagedAdamW's step is not differentiable (differentiable=True)")
    if options.get("decoupled_weight_decay") is False:
        raise ValueError("StagedAdamW is AdamW: decoupled_weight_decay must be True")


def _named(params):
    """Accepts what torch.optim takes, plus (name, tensor) pairs as model.named_parameters()
    yields, alone or as a group's "params". Returns (params for torch, {id(tensor): name})."""
    names = {}

    def strip(items):
        out = []
        for item in items:
            if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
                names[id(item[1])] = item[0]
                out.append(item[1])
            else:
                out.append(item)
        return out

    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of tensors, (name, tensor) pairs or dicts; "
                        "got a tensor")
    params = list(params)
    if params and isinstance(params[0], dict):
        groups = []
        for g in params:
            g = dict(g)
            ps = g.get("params")
            if isinstance(ps, torch.Tensor):
                ps = [ps]
            g["params"] = strip(list(ps or []))
            groups.append(g)
        return groups, names
    return strip(params), names


class _StateView:
    """`optimizer.state` as torch's AdamW has it: for each parameter that has been stepped, a
    dict of "step", "exp_avg", "exp_avg_sq" ("max_exp_avg_sq" in a group with amsgrad, and
    "master", ckpt's FP32 master weights), CPU
    copies in the parameter's shape. Read-only. With a process group it is this rank's, as
    torch's sharded optimizers keep theirs, and reading it involves no other rank: a parameter
    is there when this rank owns some of its elements, its tensors holding those elements and
    zero at the ones other ranks own (state_dict(), collective, has the whole state)."""

    def __init__(self, optimizer):
        self._optimizer = weakref.ref(optimizer)

    def _state(self):
        opt = self._optimizer()
        return opt._torch_state() if opt._owned is None else opt._local_torch_state()

    def __getitem__(self, param):
        opt = self._optimizer()
        if not any(param is p for p in opt._params):
            raise KeyError("not a parameter of this optimizer")
        # A dict of its own: what a caller puts in it (Lightning's _optimizer_to_device moves
        # each entry to the GPU by assigning into it) neither changes the next read nor stays
        # alive in the cache (a GPU copy of the whole state would).
        return dict(self._state().get(id(param), {}))

    def __contains__(self, param):
        return id(param) in self._state()

    def __iter__(self):
        by_id = self._state()
        return iter([p for p in self._optimizer()._params if id(p) in by_id])

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


def _check_muon_group(g):
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


def _shared(key):
    """An attribute kept in the optimizer's `_layout` dict, so that objects sharing a copy of
    its __dict__ (Lightning's wrapper) see it change (add_param_group changes these)."""
    return property(lambda self: self._layout[key],
                    lambda self, value: self._layout.__setitem__(key, value))


class _OverlapRun:
    """The overlapped step's mutable state, one object shared by wrappers that copy the
    optimizer's __dict__: the open ckpt_overlap (a Native child of the optimizer's), each
    released parameter's gradient version, and the step's clipping coefficient."""

    def __init__(self, enabled, gate=False):
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
        # What the hook needs, here rather than on the optimizer (wrappers copy its __dict__):
        # the optimizer's Native, its device, and id(parameter) -> index.
        self.optimizer = None
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


class _HostMirror:
    """engine="cpu" with CUDA parameters: each such parameter's gradient and weight where the
    CPU engine reads and writes them, in pinned host memory (one buffer of each, made at the
    first step and again when parameters are added). A plain step copies the gradients out on
    the current stream. An overlapped step copies each one out as its hook runs, on a stream
    of the mirror's own that waits for the stream the gradient was made on, and hands it to
    ckpt once the copy has landed (an event query at the next hooks: backward never waits for
    the copies). After the step the weights ckpt wrote are copied back in place on the current
    stream (overlap="forward": on the mirror's stream, each module's next forward waiting for
    its own); ckpt writes the buffer again only after those copies have run."""

    def __init__(self, device):
        self.device = device
        self.shape = None  # (parameters, gradient dtype) the buffers were made for.
        self.grads, self.weights = {}, {}  # Parameter index -> its 1-D pinned view.
        self.grad_ptr, self.weight_ptr = {}, {}  # Their addresses, as ckpt is handed them.
        self.stream = None  # Where an overlapped step's gradients are copied out.
        self.current = None  # The stream backward's hooks last ran on (its object).
        # Parameter index -> (event where its gradient was made, event after its copy).
        self.events = {}
        self.pending = collections.deque()  # (index, event): copies not yet seen landed.
        self.written = None  # The event after the last copies of weights back.
        self.back = {}  # Parameter index -> the event after its weight's gated copy back.

    @staticmethod
    def takes(p, g, grad_dtype):
        """Whether the mirror carries this CUDA parameter and its gradient as they are."""
        return (p.is_cuda and g.device == p.device and g.dtype is grad_dtype and
                g.is_contiguous() and p.is_contiguous())

    def fit(self, params, grad_dtype):
        """The buffers for these parameters and gradient dtype (made again when either
        changed: add_param_group, a group of another dtype)."""
        shape = (len(params), grad_dtype)
        if self.shape == shape:
            return
        self.flush()
        self.wait_written()
        index = [i for i, p in enumerate(params) if p.is_cuda]
        self.grads = self._views({i: (params[i].numel(), grad_dtype) for i in index})
        self.weights = self._views({i: (params[i].numel(), params[i].dtype) for i in index})
        self.grad_ptr = {i: t.data_ptr() for i, t in self.grads.items()}
        self.weight_ptr = {i: t.data_ptr() for i, t in self.weights.items()}
        self.shape = shape

    @staticmethod
    def _views(spans):
        """One pinned buffer cut into a 1-D view per index (64-byte aligned)."""
        at, where = 0, {}
        for i, (count, dtype) in spans.items():
            at += -at % 64
            size = count * torch.empty((), dtype=dtype).element_size()
            where[i] = (at, size, dtype)
            at += size
        buf = torch.empty(max(at, 1), dtype=torch.uint8, pin_memory=True)
        return {i: buf[a:a + size].view(dtype) for i, (a, size, dtype) in where.items()}

    def copy_out(self, index, g):
        """An overlapped step's gradient, out to the host behind the stream that made it. At
        every hook on backward's thread, so in the fewest host calls (27 us on the GPU host
        where `with torch.cuda.stream` and a fresh current_stream took 42): the current
        stream's object is kept while its id stays, and events are made once per parameter."""
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        sid = _current_stream_id(self.stream)
        if self.current is None or self.current.stream_id != sid:
            self.current = torch.cuda.current_stream(self.device)
        current = self.current
        events = self.events.get(index)
        if events is None:
            events = self.events[index] = (torch.cuda.Event(), torch.cuda.Event())
        made, copied = events
        made.record(current)  # Where backward's stream is: the gradient is final there.
        self.stream.wait_event(made)
        torch.cuda.set_stream(self.stream)
        try:
            self.grads[index].copy_(g.view(-1), non_blocking=True)
            copied.record(self.stream)
        finally:
            torch.cuda.set_stream(current)
        self.pending.append((index, copied))

    def landed(self):
        """The indices whose copies have run since the last call (in the order they were
        queued: one stream runs them in that order)."""
        out = []
        while self.pending and self.pending[0][1].query():
            out.append(self.pending.popleft()[0])
        return out

    def flush(self):
        """Every queued copy, waited for and forgotten: their indices (callers that only need
        the buffer free of the mirror's stream ignore them)."""
        out = [i for i, _ in self.pending]
        if out:
            self.stream.synchronize()
            self.pending.clear()
        return out

    def copy_in(self, params, indices, seen, gated=False):
        """The weights ckpt wrote for these parameters, back in place on the current stream;
        `seen` (the optimizer's versions) learns the versions the copies gave them. Gated
        (overlap="forward"): on the mirror's stream instead, behind what the current stream has
        queued (backward's kernels may still read the weights), in parameter order, an event
        after each; returns {index: event}, which each module's next forward waits for."""
        if not indices:
            return {}
        current = torch.cuda.current_stream(self.device)
        if self.written is None:
            self.written = torch.cuda.Event()
        after = {}
        with torch.no_grad():
            if not gated:
                for i in indices:
                    p = params[i]
                    p.detach().copy_(self.weights[i].view(p.shape), non_blocking=True)
                    seen[i] = _seen_of(p)
                self.written.record(current)
                return after
            if self.stream is None:
                self.stream = torch.cuda.Stream(self.device)
            self.stream.wait_stream(current)
            with torch.cuda.stream(self.stream):
                for i in indices:
                    p = params[i]
                    # A parameter whose storage is let go before the copy has run (p.data = ...,
                    # module.to(...)) is not reused by the allocator until then.
                    p.detach().record_stream(self.stream)
                    p.detach().copy_(self.weights[i].view(p.shape), non_blocking=True)
                    seen[i] = _seen_of(p)
                    event = self.back.get(i)
                    if event is None:
                        event = self.back[i] = torch.cuda.Event()
                    event.record(self.stream)
                    after[i] = event
            self.written.record(self.stream)
        return after

    def wait_written(self):
        """The last copies of weights back have read the buffer: ckpt may write it."""
        if self.written is not None:
            self.written.synchronize()


def _weights_on_host(params, dtype):
    """The parameters' weights flat in one new CPU tensor: of `dtype` when every parameter has
    it, else (dtype None) bytes with each parameter at a multiple of its element size (the flat
    weight buffer of ckpt_optimizer_create). Each parameter is copied into its place: nothing
    the size of the model is made on a GPU (one near full has no room for the model twice) and
    nothing is copied twice on the host."""
    with torch.no_grad():
        if dtype is not None:
            out = torch.empty(sum(p.numel() for p in params), dtype=dtype)
            at = 0
            for p in params:
                out[at:at + p.numel()].copy_(p.detach().reshape(-1))
                at += p.numel()
            return out
        spans, at = [], 0
        for p in params:
            at += -at % p.element_size()
            spans.append((at, at + p.numel() * p.element_size()))
            at = spans[-1][1]
        out = torch.zeros(at, dtype=torch.uint8)
        for p, (begin, end) in zip(params, spans):
            out[begin:end].view(p.dtype).copy_(p.detach().reshape(-1))
        return out


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


def _current_stream_id(stream):
    """The id of the current stream of `stream`'s device, as Stream.stream_id numbers it. Asked at
    every gradient hook of an overlapped step, whose host time a host-bound backward waits for:
    torch's private getter where it answers as torch 2 does (a tenth of the time of
    torch.cuda.current_stream, which builds a Stream object), else the public call."""
    getter = getattr(torch._C, "_cuda_getCurrentStream", None)
    if getter is not None:
        try:
            found = getter(stream.device_index)
            if isinstance(found, tuple) and isinstance(found[0], int):
                return found[0]
        except (RuntimeError, TypeError):
            pass
    return torch.cuda.current_stream(stream.device).stream_id


def _gradient_ready(ref, index, param):
    """A parameter's post-accumulate-grad hook: its gradient is final for this backward."""
    opt = ref()
    if opt is not None:
        opt._release(index, param)


class StagedAdamW(torch.optim.Optimizer):
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
    """

    # The CUDA engine's least compute capability for this optimizer (StagedMuon: 8, BF16 tensor
    # cores for its products); below it, the CPU engine steps CUDA parameters.
    _min_capability = 0
    # The parameters' common dtype (None when they mix), the step's gradient dtype, and the
    # elements of all parameters and of this rank.
    _dtype = _shared("dtype")
    _grad_dtype = _shared("grad_dtype")
    _total = _shared("total")
    _local_count = _shared("local_count")
    _max_slab = _shared("max_slab")  # ckpt keeps max_exp_avg_sq (some group had amsgrad).
    # The CPU engine's host copies of CUDA parameters and their gradients (None otherwise).
    _mirror = _shared("mirror")

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
        if moments not in _MOMENTS:
            raise ValueError(f"moments must be 'f32' or 'bf16', got {moments!r}")
        if engine not in ("auto", "cpu", "cuda"):
            raise ValueError(f"engine must be 'auto', 'cpu' or 'cuda', got {engine!r}")
        for key, value in (("threads", threads), ("unit_bytes", unit_bytes),
                           ("bucket_elems", bucket_elems)):
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2 ** 63:
                raise ValueError(f"{key} must be an int >= 0, got {value!r}")
        params, names = _named(params)
        self._layout = {"max_slab": False}
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay, **implementation))
        self._native = None
        # The state as torch shapes it, made on demand and dropped by anything that changes it
        # (a step, a load); shared by objects that copy this one's __dict__.
        self._cache = {}
        self._seen = []  # (version, data_ptr, shape) of each parameter as ckpt last wrote it.
        self.state = _StateView(self)
        plist = [p for g in self.param_groups for p in g["params"]]
        if not plist:
            raise ValueError("StagedAdamW got no parameters")
        for p in plist:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"parameters must be tensors, got {type(p).__name__}")
        if len({id(p) for p in plist}) != len(plist):
            raise ValueError("a parameter appears twice")
        for gi, g in enumerate(self.param_groups):
            self._check_group(g, gi)
        for p in plist:
            if p.dtype not in _DTYPES:
                raise TypeError(f"parameters must be float32, bfloat16 or float16, got {p.dtype}")
            if p.device.type not in ("cpu", "cuda"):
                raise TypeError(f"parameters on {p.device} are not supported (CPU or CUDA)")
        cuda = {p.device for p in plist if p.device.type == "cuda"}
        if len(cuda) > 1:
            raise TypeError(f"parameters on several CUDA devices ({sorted(map(str, cuda))}): "
                            "one optimizer serves one GPU (and the CPU)")
        # The engine runs where most of the elements are: CUDA parameters with a few CPU ones
        # (or the reverse) share one optimizer; the others are staged through copies.
        on_cuda = sum(p.numel() for p in plist if p.device.type == "cuda")
        device = next(iter(cuda)) if on_cuda * 2 > sum(p.numel() for p in plist) else \
            torch.device("cpu")
        if engine == "cpu":
            device = torch.device("cpu")  # CUDA parameters staged through host copies.
        elif engine == "cuda" and device.type != "cuda":
            if not cuda:
                raise ValueError("engine='cuda' needs parameters on a CUDA device")
            device = next(iter(cuda))
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        if capability is not None and capability[0] < self._min_capability:
            if engine == "cuda":
                raise ValueError(f"engine='cuda' needs compute capability "
                                 f"{self._min_capability} or newer for {type(self).__name__}; "
                                 f"{device} has {capability}: use engine='auto'")
            # StagedMuon on a GPU without BF16 tensor cores: the CPU engine, the CUDA parameters
            # staged through host copies.
            device = torch.device("cpu")
        if process_group is not None and any(p.device != device for p in plist):
            raise NotImplementedError(
                "parameters on two devices with a process_group are not supported yet")
        self._devices = [p.device for p in plist]
        # Each parameter keeps its own dtype; _dtype is theirs when they share one, else None.
        self._dtypes = [p.dtype for p in plist]
        self._shapes = [tuple(p.shape) for p in plist]  # As checkpoints record them.
        dtype = plist[0].dtype if len(set(self._dtypes)) == 1 else None
        if dtype is None and process_group is not None:
            raise NotImplementedError("parameters of several dtypes with a process_group are not "
                                      "supported yet: one dtype per data-parallel optimizer")
        self._dtype, self._device = dtype, device
        self._mirror = _HostMirror(next(iter(cuda))) if device.type == "cpu" and cuda else None
        self._params = plist
        self._names = [names.get(id(p), f"param.{i}") for i, p in enumerate(plist)]
        if len(set(self._names)) != len(self._names):
            raise ValueError("parameter names repeat")
        encoded = [_lib.encode_text(n, "parameter name") for n in self._names]
        group_of = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        # Each parameter keeps its own storage: ckpt reads its gradient and writes it in place
        # (one piece per parameter). _slices: where each lies in ckpt's flat order.
        total = 0
        self._slices = []
        for p in plist:
            self._slices.append((total, p.numel()))
            total += p.numel()
        self._total = total
        # Data-parallel gradients are averaged in FP32 (gloo cannot all-reduce BF16, and a sum
        # in F16 overflows where the mean would not); ckpt's step takes FP32 gradients too.
        # With several parameter dtypes the step takes FP32 gradients (exact for each).
        grad_dtype = torch.float32 if process_group is not None or dtype is None else dtype
        self._grad_dtype = grad_dtype
        self._scratch = {}  # Buffers made once and reused (the zero gradient); shared.
        shapes = [(ctypes.c_uint64 * max(1, p.dim()))(*p.shape) for p in plist]
        specs = (_lib.Param * len(plist))(*[
            _lib.Param(encoded[i], shapes[i], plist[i].dim(), _DTYPES[plist[i].dtype],
                       group_of[id(plist[i])]) for i in range(len(plist))])
        groups = (_lib.Group * len(self.param_groups))(*[self._group(g) for g in self.param_groups])
        self._group_handle = process_group
        self._reduce_grads = reduce_grads
        if process_group is not None:
            import torch.distributed as dist
            rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
            count = ctypes.c_size_t()
            muon = {id(p) for g in self.param_groups if g.get("use_muon") for p in g["params"]}
            if muon:  # Each Muon matrix whole on one rank (docs/design/muon.md).
                whole = (ctypes.c_uint8 * len(plist))(*[int(id(p) in muon) for p in plist])

                def rank_pieces(out, capacity):
                    check(lib.ckpt_rank_pieces_keeping_whole(
                        specs, len(plist), whole, bucket_elems, world, rank, out, capacity,
                        ctypes.byref(count)))
            else:
                def rank_pieces(out, capacity):
                    check(lib.ckpt_rank_pieces(specs, len(plist), bucket_elems, world, rank, out,
                                               capacity, ctypes.byref(count)))
            rank_pieces(None, 0)
            pieces = (_lib.Piece * max(1, count.value))()
            rank_pieces(pieces, count.value)
            npieces = count.value
            # (offset in the flat order, offset in this rank's slabs, count) per piece.
            self._owned = []
            at = 0
            for i in range(npieces):
                q = pieces[i]
                self._owned.append((self._slices[q.param][0] + q.begin, at, q.count))
                at += q.count
            local = at
            # Private buffers, not the parameters' storage: the averaged gradients, this rank's
            # pieces of them and of the weights, and the weights as the ranks exchange them.
            self._grads = torch.zeros(total, dtype=grad_dtype, device=device)
            self._local_grads = torch.empty(local, dtype=grad_dtype, device=device)
            self._local_params = torch.empty(local, dtype=dtype, device=device)
            self._flat = torch.empty(total, dtype=dtype, device=device)
        else:
            pieces = (_lib.Piece * len(plist))(*[_lib.Piece(i, 0, n) for i, (_, n) in
                                                 enumerate(self._slices)])
            npieces = len(plist)
            self._owned = None
            local = total
        self._local_count = local
        # This rank's weights in slab order, in host memory: the masters start from them.
        full = _weights_on_host(plist, dtype)
        host = self._local_of(full, dtype) if dtype is not None else full
        options = _lib.OptimizerOptions(
            _lib.ENGINE_CUDA if device.type == "cuda" else _lib.ENGINE_CPU, unit_bytes, threads, 0,
            _MOMENTS[moments])
        handle = ctypes.c_void_p()
        check(lib.ckpt_optimizer_create(specs, len(plist), groups, len(self.param_groups), pieces,
                                        npieces, ctypes.byref(options), host.data_ptr(),
                                        host.numel() * host.element_size(),
                                        ctypes.byref(handle)))
        del full, host
        # The one owner of the handle (ckpt/_native.py): wrappers that copy this object's
        # __dict__ share it, and it is freed when the last of them goes, or by close().
        self._native = Native(handle, lib.ckpt_optimizer_destroy, "optimizer")
        self._max_slab = any(g.get("amsgrad", False) for g in self.param_groups)
        if overlap not in (False, True, "forward"):
            self.close()
            raise ValueError(f"overlap must be False, True or \"forward\", not {overlap!r}")
        self._ov = _OverlapRun(bool(overlap), gate=overlap == "forward")
        if overlap:
            if not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
                self.close()
                raise NotImplementedError(
                    f"overlap=True needs post-accumulate-grad hooks (torch >= 2.1); this is "
                    f"torch {torch.__version__}")
            if process_group is not None:
                self.close()
                raise NotImplementedError("overlap=True with a process_group is not supported "
                                          "yet")
            ref = weakref.ref(self)
            self._ov.hooks = [p.register_post_accumulate_grad_hook(
                functools.partial(_gradient_ready, ref, i)) for i, p in enumerate(plist)]
        self._note_versions()

    @staticmethod
    def _check_group(g, index):
        """A param group's hyper-parameters, as torch AdamW accepts them, and its implementation
        choices (ckpt's limits): ValueError naming the group's index and the key."""
        try:
            StagedAdamW._check_group_keys(g)
        except ValueError as e:
            raise ValueError(f"param group {index}: {e}") from None

    @staticmethod
    def _check_group_keys(g):
        """A param group's hyper-parameters, as torch AdamW accepts them (ValueError naming the
        key), and its implementation choices (ckpt's limits)."""
        for key in ("lr", "eps", "weight_decay"):
            v = g[key]
            if not _is_number(v) or not float(v) >= 0 or float(v) == float("inf"):
                raise ValueError(f"{key} must be a finite number >= 0, got {v!r}")
        b = g["betas"]
        if (not isinstance(b, (tuple, list)) or len(b) != 2 or
                not all(_is_number(x) and 0 <= float(x) < 1 for x in b)):
            raise ValueError(f"betas must be two numbers in [0, 1), got {b!r}")
        _check_implementation_choices(g)
        if g.get("use_muon"):
            if "momentum" not in g:  # Not a StagedMuon's group.
                raise ValueError("use_muon: Muon groups are StagedMuon's (ckpt.torch.StagedMuon)")
            _check_muon_group(g)

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

    @staticmethod
    def _group(g):
        b1, b2 = g["betas"]
        c = _lib.Group(float(g["lr"]), float(b1), float(b2), float(g["eps"]),
                       float(g["weight_decay"]), 0, int(bool(g.get("amsgrad", False))))
        if g.get("use_muon"):  # StagedMuon's groups (docs/design/muon.md).
            c.algorithm = _lib.MUON
            c.momentum = float(g["momentum"])
            c.nesterov = int(bool(g["nesterov"]))
            c.ns_a, c.ns_b, c.ns_c = (float(x) for x in g["ns_coefficients"])
            c.ns_steps = int(g["ns_steps"])
            c.adjust_lr = _MUON_LR[g["adjust_lr_fn"]]
        return c

    def _muon_ids(self):
        """The ids of the parameters of Muon groups (StagedMuon's use_muon groups)."""
        return {id(p) for g in self.param_groups if g.get("use_muon") for p in g["params"]}

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
        if self._owned is not None:
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
        self._check_group(group, len(self.param_groups) - 1)
        new = list(group["params"])
        first = len(self._params)
        for p in new:
            if p.dtype not in _DTYPES:
                raise TypeError(f"parameters must be float32, bfloat16 or float16, got {p.dtype}")
            if p.device.type not in ("cpu", "cuda"):
                raise TypeError(f"parameters on {p.device} are not supported (CPU or CUDA)")
        cuda = {d for d in self._devices + [p.device for p in new] if d.type == "cuda"}
        if len(cuda) > 1:
            raise TypeError(f"parameters on several CUDA devices ({sorted(map(str, cuda))}): "
                            "one optimizer serves one GPU (and the CPU)")
        new_names = [names.get(id(p), f"param.{first + i}") for i, p in enumerate(new)]
        if len(set(new_names) | set(self._names)) != len(new_names) + len(self._names):
            raise ValueError("parameter names repeat")
        encoded = [_lib.encode_text(n, "parameter name") for n in new_names]
        shapes = [(ctypes.c_uint64 * max(1, p.dim()))(*p.shape) for p in new]
        gi = len(self.param_groups) - 1
        specs = (_lib.Param * len(new))(*[
            _lib.Param(encoded[i], shapes[i], new[i].dim(), _DTYPES[new[i].dtype], gi)
            for i in range(len(new))])
        pieces = (_lib.Piece * len(new))(*[_lib.Piece(first + i, 0, p.numel())
                                           for i, p in enumerate(new)])
        host = _weights_on_host(new, None)  # The new pieces' own flat weight buffer.
        check(lib.ckpt_optimizer_add_params(self._live(), specs, len(new),
                                            ctypes.byref(self._group(group)), 1, pieces, len(new),
                                            host.data_ptr(), host.numel()))
        # ckpt has them: the tables follow, in place (shared with __dict__ copies).
        self._max_slab = self._max_slab or bool(group.get("amsgrad", False))
        total = self._total
        for p in new:
            self._slices.append((total, p.numel()))
            total += p.numel()
        self._params.extend(new)
        self._names.extend(new_names)
        self._dtypes.extend(p.dtype for p in new)
        self._shapes.extend(tuple(p.shape) for p in new)
        self._devices.extend(p.device for p in new)
        if self._mirror is None and self._device.type == "cpu" and cuda:
            self._mirror = _HostMirror(next(iter(cuda)))
        self._seen.extend(_seen_of(p) for p in new)
        self._total = self._local_count = total
        self._layout.pop("consolidated", None)
        if self._dtype is not None and any(p.dtype != self._dtype for p in new):
            self._dtype, self._grad_dtype = None, torch.float32
        self._state_changed()

    def zero_grad(self, set_to_none=None):
        """torch's zero_grad (set_to_none: torch's default when not given). An overlapped step
        still open (its step() was skipped, as GradScaler skips a step whose gradients
        overflowed) is abandoned first: the weights it wrote during backward go back to the
        masters before the next forward reads them."""
        run = getattr(self, "_ov", None)
        if run is not None:
            if run.native is not None:
                self._drop_overlap()
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
        grads = [p.grad for p in self._params if p.grad is not None]
        if not grads:
            self._ov.coef = None
            return torch.tensor(0.0)
        norm_type = float(norm_type)
        device = grads[0].device
        norms = [torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float32).to(device)
                 for g in grads]
        total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        self._ov.coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        return total

    def _take_coef(self):
        """The clipping coefficient for this step (1.0 without clip_grad_norm), as a float."""
        coef, self._ov.coef = self._ov.coef, None
        if coef is None:
            return 1.0
        value = float(coef.item())
        return value if value == value and value not in (float("inf"), float("-inf")) else 1.0

    def _fast(self, p, g):
        """Whether ckpt reads this gradient and writes this parameter where they are (the
        overlapped step's condition; the plain step converts and stages the others)."""
        return (g.dtype is self._grad_dtype and g.is_contiguous() and g.device == self._device
                and p.device == self._device and p.is_contiguous())

    def _overlappable(self, p, g):
        """Whether an overlapped step can take this gradient: where ckpt reads it, or (the CPU
        engine's CUDA parameters) through the host mirror."""
        mirror = self._mirror
        if mirror is not None and p.is_cuda:
            return mirror.takes(p, g, self._grad_dtype)
        return self._fast(p, g)

    def _release(self, index, p):
        """The post-accumulate-grad hook's work: parameter `index`'s gradient is final. Runs on
        backward's thread at every parameter, whose host time a host-bound backward waits for:
        the ctypes arguments of each parameter are made once and refilled."""
        with self._ov.lock:
            self._release_locked(index, p)

    def _release_locked(self, index, p):
        run = self._ov
        if (not run.enabled or not run.speculate or run.depth > 0 or run.failed or
                self._native is None or self._native.closed):
            return  # This step runs plainly.
        g = p.grad
        if g is None or not self._overlappable(p, g):
            self._drop_overlap()
            run.failed = True
            return
        if run.native is None and not self._begin_overlap(run):
            return
        mirror = self._mirror
        if mirror is not None and p.is_cuda:
            # CPU engine: out to the host first; ckpt gets the gradients whose copies landed.
            mirror.copy_out(index, g)
            run.keep.append((p, g))
            twice = index in run.released  # ckpt refuses it (undeclared accumulation): now.
            run.released[index] = (g, g._version)
            self._hand_over(mirror.flush() if twice else mirror.landed())
            return
        if run.stream is not None and _current_stream_id(run.stream) != run.stream.stream_id:
            # This gradient was made on another stream.
            run.stream.wait_stream(torch.cuda.current_stream(self._device))
        run.keep.append((p, g))
        args = run.args.get(index)
        if args is None:
            args = run.args[index] = ((ctypes.c_uint32 * 1)(index), (ctypes.c_void_p * 1)(),
                                      (ctypes.c_void_p * 1)())
        args[1][0], args[2][0] = g.data_ptr(), p.data_ptr()
        try:
            check(lib.ckpt_overlap_release(run.native.handle, args[0], args[1], args[2], 1))
        except CkptError:
            self._drop_overlap()  # Abandoned by ckpt: the weights are the masters again.
            raise
        run.released[index] = (g, g._version)

    def _begin_overlap(self, run):
        """Opens the overlapped step at backward's first hook. False when it cannot (this
        step runs plainly)."""
        scale, flip = self._grad_scale()
        if flip:
            run.failed = True
            return False
        handle = self._push_groups()  # Hyper-parameters and edited parameters, first.
        out = ctypes.c_void_p()
        run.stream = torch.cuda.current_stream(self._device) \
            if self._device.type == "cuda" else None
        self.wait_for_step()  # The last step's gate, if a forward left it open.
        mirror = self._mirror
        if mirror is not None:
            mirror.fit(self._params, self._grad_dtype)
            mirror.flush()
            mirror.wait_written()  # ckpt writes the weights' buffer from now on.
        try:
            if run.gate and run.stream is not None:
                check(lib.ckpt_overlap_begin_gated(
                    handle, _DTYPES[self._grad_dtype], scale, run.stream.cuda_stream, 0,
                    ctypes.byref(out)))
            else:  # Speculate: a step that would not, runs plainly.
                check(lib.ckpt_overlap_begin(
                    handle, _DTYPES[self._grad_dtype], scale,
                    run.stream.cuda_stream if run.stream is not None else None,
                    1, ctypes.byref(out)))
        except CkptError as e:
            # E.g. no host memory for the spare side: this step and the next ones run
            # plainly.
            warnings.warn(f"ckpt: the overlapped step could not begin ({e}); stepping "
                          "plainly from now on")
            run.failed, run.enabled = True, False
            return False
        run.native = Native(out, lib.ckpt_overlap_destroy, "overlapped step",
                            parents=(self._native,))
        return True

    def _hand_over(self, indices):
        """The CPU engine's CUDA parameters whose gradients have reached the host mirror, to
        ckpt (which updates their units on its feeder thread, writing the mirror's weights)."""
        if not indices:
            return
        mirror, k = self._mirror, len(indices)
        try:
            check(lib.ckpt_overlap_release(
                self._ov.native.handle, (ctypes.c_uint32 * k)(*indices),
                (ctypes.c_void_p * k)(*[mirror.grad_ptr[i] for i in indices]),
                (ctypes.c_void_p * k)(*[mirror.weight_ptr[i] for i in indices]), k))
        except CkptError:
            self._drop_overlap()  # Abandoned by ckpt: the CUDA weights were never written.
            raise

    def _drain_overlap(self):
        """Waits until ckpt has updated every parameter released so far (tests: the step
        then finds them all speculated)."""
        if self._ov.native is not None:
            if self._mirror is not None:
                self._hand_over(self._mirror.flush())
            check(lib.ckpt_overlap_drain(self._ov.native.handle))

    def _drop_overlap(self):
        """Abandons the open overlapped step, if any: the state stays as before the step and
        the weights it wrote are rewritten from the masters."""
        run = self._ov
        with run.lock:
            native, run.native, run.released = run.native, None, {}
            if self._mirror is not None:
                self._mirror.flush()  # Before the gradients the copies read can go.
            if native is not None:
                native.close()
            run.keep = []

    # Module types whose forward pre-hook waits for their whole subtree (overlap="forward").
    gate_whole = _GATE_WHOLE

    def _open_gate(self, grad_of):
        """After a gated step held: each stepped parameter waits for its module's forward (or
        wait_for_step), its gradient kept alive until then."""
        is_open = ctypes.c_int(0)
        check(lib.ckpt_optimizer_gate_open(self._native.handle, ctypes.byref(is_open)))
        if not is_open.value:
            return
        self._gate_on({i: g for i, g in enumerate(grad_of) if g is not None}, False,
                      self._device)

    def _gate_mirror(self, after):
        """After the host mirror's gated copies back (overlap="forward" on the CPU engine):
        each parameter waits for its copy's event at its module's forward (or wait_for_step)."""
        if after:
            self._gate_on(after, True, self._mirror.device)

    def _gate_on(self, gated, by_events, device):
        run = self._ov
        run.gated, run.by_events = gated, by_events
        run.optimizer, run.device, run.whole = self._native, device, tuple(self.gate_whole)
        if len(run.index_of) != len(self._params):  # add_param_group added some.
            run.index_of = {id(p): i for i, p in enumerate(self._params)}
        if run.gate_hook is None:
            run.gate_hook = torch.nn.modules.module.register_module_forward_pre_hook(
                functools.partial(_gate_forward, weakref.ref(run)))

    def wait_for_step(self):
        """After a step of overlap="forward": what the current stream runs next sees every
        parameter this step wrote (the forward's own modules wait for theirs by themselves).
        Call it before reading parameters outside their module's forward (an EMA update, a
        weight read elsewhere, a save of the model) ahead of the next forward; before code that
        zeroes or writes gradients in place other than this optimizer's zero_grad; and before
        capturing a CUDA graph. A no-op otherwise."""
        run = getattr(self, "_ov", None)
        if run is None or not run.gated:
            return
        if run.by_events:  # The host mirror's copies back: the event after the last one.
            torch.cuda.current_stream(run.device).wait_event(self._mirror.written)
        elif self._native is not None and not self._native.closed:
            check(lib.ckpt_optimizer_await_step(self._native.handle, self._stream()))
        run.gated = {}  # Freed after the wait: on the stream that waited.
        _drop_gate_hook(run)

    def _stream(self):
        if self._device.type == "cuda":
            return torch.cuda.current_stream(self._device).cuda_stream
        return None

    def _finish_overlap(self, coef):
        """Ends the open overlapped step as the plain step would run. False when it cannot (a
        gradient ckpt would have to convert, a maximize mix, nothing to step): the overlap is
        abandoned and the plain step runs."""
        run = self._ov
        native, released = run.native, run.released
        run.native, run.released = None, {}
        keep, run.keep = run.keep, []  # Alive until the overlap is closed (finally).
        try:
            grad_of = [p.grad for p in self._params]
            stepped = [g is not None for g in grad_of]
            scale, flip = self._grad_scale()
            if (not any(stepped) or flip or
                    not all(self._overlappable(p, g) for p, g in zip(self._params, grad_of)
                            if g is not None)):
                return False
            handle = self._live()
            for gi, g in enumerate(self.param_groups):  # A scheduler may have run since.
                self._check_group(g, gi)
                check(lib.ckpt_optimizer_set_group(handle, gi, ctypes.byref(self._group(g))))
            changed = any(grad_of[i] is not g or g._version != v
                          for i, (g, v) in released.items())
            if changed:
                check(lib.ckpt_overlap_invalidate(native.handle))  # Changed in place since.
            run.speculate = coef == 1.0 and not changed
            run.in_place = changed
            self._state_changed()
            self._layout.pop("consolidated", None)
            n = len(self._params)
            grads = [g.data_ptr() if g is not None else None for g in grad_of]
            params = [p.data_ptr() if g is not None else None
                      for p, g in zip(self._params, grad_of)]
            mirror = self._mirror
            mirrored = []  # The CPU engine's CUDA parameters, stepped through the mirror.
            if mirror is not None:
                # Every copy queued has landed; those ckpt was not handed yet are stepped by
                # Finish like any unit not speculated. A gradient without a copy (no hook ran
                # for it) or changed since its copy is copied now.
                mirror.flush()
                if changed:  # Its feeder reads no mirror gradient while they are copied again.
                    check(lib.ckpt_overlap_drain(native.handle))
                late = False
                for i, g in enumerate(grad_of):
                    if g is None or not self._params[i].is_cuda:
                        continue
                    mirrored.append(i)
                    grads[i], params[i] = mirror.grad_ptr[i], mirror.weight_ptr[i]
                    if changed or i not in released:
                        mirror.grads[i].copy_(g.view(-1), non_blocking=True)
                        late = True
                if late:
                    torch.cuda.current_stream(mirror.device).synchronize()
            skipped, held = ctypes.c_int(0), ctypes.c_int(0)
            speculated = ctypes.c_uint64(0)
            check(lib.ckpt_overlap_finish(
                native.handle, (ctypes.c_void_p * n)(*grads), (ctypes.c_void_p * n)(*params),
                n, (ctypes.c_uint8 * n)(*stepped), n, _DTYPES[self._grad_dtype], scale * coef,
                0, self._stream(), ctypes.byref(skipped), ctypes.byref(speculated),
                ctypes.byref(held)))
            run.last = (speculated.value, bool(held.value))
            if mirrored and not skipped.value:
                self._gate_mirror(mirror.copy_in(self._params, mirrored, self._seen,
                                                 gated=run.gate))
            elif held.value and run.gate:
                self._open_gate(grad_of)
            return True
        finally:
            native.close()
            if self._mirror is not None:
                self._mirror.flush()  # Copies still queued read gradients `keep` holds.
            del keep

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
        coef = self._take_coef()
        run = self._ov
        run.failed = False
        run.last = None
        self.wait_for_step()  # The last step's gate, if no forward ran since.
        if run.native is not None and self._finish_overlap(coef):
            return loss
        if run.enabled and run.native is None:
            run.speculate = coef == 1.0 and not run.in_place
        # As torch: a parameter whose .grad is None is not stepped (nor decayed), and its own
        # step count does not advance; a step in which none has a gradient changes nothing.
        grad_of = [p.grad for p in self._params]
        stepped = [g is not None for g in grad_of]
        if self._owned is not None:
            # What may fail on one rank alone runs before the ranks' first collective, and that
            # collective carries the failure: every rank raises, none waits for the others.
            failure = None
            try:
                handle = self._push_groups()  # Also refreshes edited parameters.
                scale, flip = self._grad_scale()
            except Exception as e:  # noqa: BLE001 (re-raised on this rank below)
                failure = e
            stepped, failed = self._agree(stepped, failure is not None)
            if failed:
                if failure is not None:
                    raise failure
                raise CkptError(Code.ABORTED,
                                "step(): another rank of the process group failed before "
                                "stepping; no rank stepped")
            if not any(stepped):
                return loss
        else:
            if not any(stepped):
                self._refresh_edited()  # Nothing steps, but an edit is seen now, not later.
                return loss
            handle = self._push_groups()  # Also refreshes edited parameters (and checks them).
            scale, flip = self._grad_scale()
        scale *= coef
        self._state_changed()
        self._layout.pop("consolidated", None)
        stream = None
        if self._device.type == "cuda":
            stream = torch.cuda.current_stream(self._device).cuda_stream
        n = len(self._params)
        mask = (ctypes.c_uint8 * n)(*stepped)
        skipped = ctypes.c_int(0)
        if self._owned is None:
            # Every gradient read and every parameter written in place, in one call. torch
            # keeps a gradient on its parameter's device and of its dtype; it is converted
            # when the step takes FP32 gradients (several parameter dtypes) or is strided.
            keep = []  # Gradients converted for ckpt, alive until the call returns.
            staged = []  # (parameter, contiguous copy) of non-contiguous parameters.
            grads, params = [], []
            want = self._grad_dtype
            device = self._device
            mirror = self._mirror
            mirrored = []  # CUDA parameters the CPU engine steps through the host mirror.
            if mirror is not None:
                mirror.fit(self._params, want)
                mirror.flush()
            for i, (p, g, ptr, home) in enumerate(zip(self._params, grad_of, self._seen,
                                                       self._devices)):
                if g is None:
                    grads.append(None)
                    params.append(None)
                    continue
                if mirror is not None and home.type == "cuda" and p.is_contiguous():
                    # Converted on the GPU if need be, then out to the pinned host copy.
                    if g.dtype is not want or not g.is_contiguous():
                        g = g.to(dtype=want).contiguous()
                        keep.append(g)
                    if i in flip:
                        g = g.neg()
                        keep.append(g)
                    mirror.grads[i].copy_(g.view(-1), non_blocking=True)
                    grads.append(mirror.grad_ptr[i])
                    params.append(mirror.weight_ptr[i])
                    mirrored.append(i)
                    continue
                if g.dtype is not want or not g.is_contiguous() or home != device:
                    g = g.to(device=device, dtype=want).contiguous()
                    keep.append(g)
                if i in flip:  # maximize in this parameter's group only: a negated copy.
                    g = g.neg()
                    keep.append(g)
                grads.append(g.data_ptr())
                if home != device or not p.is_contiguous():
                    # ckpt writes elements in row-major order, on its engine's device: through
                    # a contiguous copy there.
                    staged.append((p, p.detach().to(device).contiguous()))
                    params.append(staged[-1][1].data_ptr())
                else:
                    params.append(ptr[1])
            if self._ov.gate and stream is not None and not keep and not staged:
                # overlap="forward" with nothing speculated (clipping fired): the plain step,
                # gated, so that the next forward still hides it layer by layer.
                gated = ctypes.c_int(0)
                with self._device_settled_on_failure():
                    check(lib.ckpt_optimizer_step_gated(
                        handle, (ctypes.c_void_p * n)(*grads), (ctypes.c_void_p * n)(*params), n,
                        mask, n, _DTYPES[self._grad_dtype], scale, 0, stream,
                        ctypes.byref(skipped), ctypes.byref(gated)))
                if gated.value:
                    self._open_gate(grad_of)
                return loss
            if mirrored:
                torch.cuda.current_stream(mirror.device).synchronize()  # The gradients landed.
                mirror.wait_written()  # The last step's weights have left the buffer.
            with self._device_settled_on_failure():
                check(lib.ckpt_optimizer_step_masked(
                    handle, (ctypes.c_void_p * n)(*grads), (ctypes.c_void_p * n)(*params), n,
                    mask, n, _DTYPES[self._grad_dtype], scale, 0, stream, ctypes.byref(skipped)))
            del keep
            if mirrored and not skipped.value:
                self._gate_mirror(mirror.copy_in(self._params, mirrored, self._seen,
                                                 gated=self._ov.gate))
            if staged:
                for p, copy in staged:
                    p.detach().copy_(copy)
                self._note_versions()
            return loss
        import torch.distributed as dist
        for p, (o, count) in zip(self._params, self._slices):
            if p.grad is None:
                self._grads[o:o + count].zero_()
            else:
                self._grads[o:o + count].copy_(p.grad.reshape(-1))
        if self._reduce_grads:
            dist.all_reduce(self._grads, group=self._group_handle)
            self._grads.div_(dist.get_world_size(self._group_handle))
        for i in flip:  # maximize in this parameter's group only.
            o, count = self._slices[i]
            self._grads[o:o + count].neg_()
        self._gather(self._grads, self._local_grads)
        gsize, psize = self._local_grads.element_size(), self._local_params.element_size()
        gbase, pbase = self._local_grads.data_ptr(), self._local_params.data_ptr()
        grads = [gbase + local_at * gsize for _, local_at, _ in self._owned]
        params = [pbase + local_at * psize for _, local_at, _ in self._owned]
        k = len(self._owned)
        failure = None
        try:
            check(lib.ckpt_optimizer_step_masked(
                handle, (ctypes.c_void_p * k)(*grads), (ctypes.c_void_p * k)(*params), k, mask,
                n, _DTYPES[self._local_grads.dtype], scale, 0, stream, ctypes.byref(skipped)))
        except CkptError as e:
            failure = e
        # Before the exchange: a rank whose step failed would otherwise leave the others
        # waiting in it.
        if self._any_rank(failure is not None):
            if failure is not None:
                raise failure
            raise CkptError(Code.ABORTED,
                            "step(): another rank of the process group failed in its step; "
                            "this rank stepped its own pieces, which the others did not "
                            "receive: load the last checkpoint")
        self._exchange(self._local_params)
        self._scatter(self._flat, only=stepped)
        return loss

    @contextlib.contextmanager
    def _device_settled_on_failure(self):
        """A native step that fails on the CUDA engine may have queued work that still reads
        the gradients: the device is waited for before the error reaches the caller, who may
        then free them (the converted copies go at once) or zero them in place."""
        try:
            yield
        except CkptError:
            if self._device.type == "cuda":
                try:
                    torch.cuda.synchronize(self._device)
                except RuntimeError:
                    pass  # A device error: nothing it queued runs any more.
            raise

    def _agree(self, stepped, failed=False):
        """Data parallel: the parameters any rank has a gradient for (the ranks must step the
        same ones; a rank without one contributes zeros to the average), and whether any rank
        `failed` (one collective)."""
        import torch.distributed as dist
        flags = self._reduced("stepped", len(stepped) + 1, torch.int32)
        flags.copy_(torch.tensor([*stepped, failed], dtype=torch.int32))
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group_handle)
        agreed = [bool(x) for x in flags.tolist()]
        return agreed[:-1], agreed[-1]

    def _any_rank(self, flag):
        """Data parallel: whether `flag` holds on any rank (collective)."""
        import torch.distributed as dist
        word = self._reduced("any", 1, torch.int32)
        word.fill_(int(bool(flag)))
        dist.all_reduce(word, op=dist.ReduceOp.MAX, group=self._group_handle)
        return bool(word.item())

    def _state_changed(self):
        """The state changes (a step, a load, edited parameters taken in, a group added):
        cached views of it go, and the generation moves, so that what a Checkpointer or an
        integration remembers the state equalled no longer holds."""
        self._cache.clear()
        self._layout["generation"] = self._layout.get("generation", 0) + 1

    def _generation(self):
        """A value that stays the same exactly while the state does: what ckpt holds (moved by
        _state_changed) and what each parameter is (an edit is taken in at the next step)."""
        return self._layout.get("generation", 0), tuple(_seen_of(p) for p in self._params)

    def _note_versions(self):
        """What each parameter is now (_seen_of), so that the next step can tell which ones the
        trainer changed in place."""
        # In place: objects that copy this one's __dict__ share the list.
        self._seen[:] = [_seen_of(p) for p in self._params]

    def _refresh_edited(self):
        """A parameter changed since ckpt last wrote it (model.load_state_dict, p.mul_() under
        no_grad, re-initialisation, an EMA swap: anything that bumps its version counter or
        replaces its storage) becomes its own master before the step, as torch AdamW would
        continue from the edited value: the master takes the parameter's value widened to FP32
        (for a BF16 or FP16 parameter, the low bits the master had beyond the parameter's
        precision are gone). Moments and step counts stay."""
        now = [_seen_of(p) for p in self._params]
        if now == self._seen:
            return
        edited = [i for i, (a, b) in enumerate(zip(now, self._seen)) if a != b]
        # A parameter that now has another dtype, device or size is refused before anything
        # is read from it.
        self._check_parameters(edited)
        handle = self._live()
        self._state_changed()
        for i in edited:
            p = self._params[i]
            values = p.detach().reshape(-1).float().cpu()
            if not torch.isfinite(values).all():
                raise ValueError(f"parameter {self._names[i]} was set to a non-finite value")
            o, count = self._slices[i]
            if self._owned is None:
                check(lib.ckpt_optimizer_set_masters(handle, o, values.data_ptr(), count))
                continue
            for flat_at, local_at, k in self._owned:
                if o <= flat_at < o + count:
                    part = values[flat_at - o:flat_at - o + k].contiguous()
                    check(lib.ckpt_optimizer_set_masters(handle, local_at, part.data_ptr(), k))
        self._seen[:] = now

    def _check_parameters(self, indices):
        """Each of these parameters (indices into _params) still of the dtype, device and shape
        ckpt reads and writes and its checkpoints record (CkptError naming the first that is
        not; torch's AdamW fails on a reshaped parameter too). Run on the parameters whose
        version or storage changed: nothing else changes a parameter's dtype, device or
        shape."""
        for i in indices:
            p, name, dtype, shape = self._params[i], self._names[i], self._dtypes[i], \
                self._shapes[i]
            if p.dtype != dtype or p.device != self._devices[i] or tuple(p.shape) != shape:
                raise CkptError(Code.FAILED_PRECONDITION,
                                f"parameter {name} changed: {p.dtype} on {p.device}, shape "
                                f"{list(p.shape)} (built with {dtype} on "
                                f"{self._devices[i]}, shape {list(shape)})")

    def _scatter(self, flat, only=None):
        """A flat buffer in ckpt's order into the parameters (those `only` flags, or all), in
        place."""
        with torch.no_grad():
            for i, (p, (o, n)) in enumerate(zip(self._params, self._slices)):
                if only is None or only[i]:
                    p.detach().copy_(flat[o:o + n].view(p.shape))
        self._note_versions()

    def _gather(self, full, local):
        """This rank's pieces of a full flat buffer, into `local` (slab order)."""
        if self._owned is None:
            local.copy_(full)
            return
        for flat_at, local_at, n in self._owned:
            local[local_at:local_at + n].copy_(full[flat_at:flat_at + n])

    def _exchange(self, local):
        """Every rank's updated pieces into every rank's parameters: each rank places its own
        in a zeroed full buffer and the ranks sum them bit pattern for bit pattern (each element
        has exactly one owner), which is exact in any dtype."""
        import torch.distributed as dist
        nbytes = self._flat.numel() * self._flat.element_size()
        # Summed as int32 words: each bit comes from one rank at most, so the sum is the OR of
        # the ranks' bits, with no carry (2-byte elements of two owners may share a word).
        # Kept (reused) after the call: a tensor whose last reference gloo's worker thread drops
        # crashes a process that exits right after (pytorch/pytorch#179291); see _reduced.
        words = self._reduced("exchange", (nbytes + 3) // 4, torch.int32)
        words.zero_()
        full = words.view(torch.uint8)[:nbytes].view(self._flat.dtype)
        for flat_at, local_at, n in self._owned:
            full[flat_at:flat_at + n].copy_(local[local_at:local_at + n])
        dist.all_reduce(words, group=self._group_handle)
        self._flat.copy_(full)

    def _push_groups(self):
        """param_groups' hyper-parameters into ckpt: before every step, and before a save (so
        the checkpoint holds what the next step will use, e.g. after a scheduler's step)."""
        handle = self._live()
        for gi, g in enumerate(self.param_groups):
            self._check_group(g, gi)
            check(lib.ckpt_optimizer_set_group(handle, gi, ctypes.byref(self._group(g))))
        self._refresh_edited()  # A save holds the parameters as the trainer left them.
        return handle

    def _state(self, which):
        """One state tensor over every parameter (data-parallel: gathered from the ranks, so
        every rank must call it)."""
        handle = self._live()
        self._refresh_edited()
        local = torch.empty(self._local_count, dtype=torch.float32)
        check(lib.ckpt_optimizer_read_state(handle, which, local.data_ptr(), local.numel()))
        if self._owned is None:
            return local
        import torch.distributed as dist
        # On the parameters' device: NCCL reduces device tensors only.
        full = self._reduced("state", self._total, torch.float32)
        full.zero_()
        for flat_at, local_at, n in self._owned:
            full[flat_at:flat_at + n].copy_(local[local_at:local_at + n])
        dist.all_reduce(self._scratch["state_words"], group=self._group_handle)
        return full.cpu() if full.device.type != "cpu" else full.clone()

    def _reduced(self, name, count, dtype):
        """A buffer this optimizer all-reduces, made once and kept with the exact tensor object
        passed to the collective: torch's gloo worker thread may drop its reference to a reduced
        tensor after the call returned, and if that is the last one while the interpreter exits,
        freeing it takes the GIL from a dying thread and aborts the process
        (pytorch/pytorch#179291). Kept here, the last reference is never gloo's."""
        if name not in self._scratch or self._scratch[name].numel() != count:
            buf = torch.zeros(count, dtype=dtype, device=self._device)
            if name in self._scratch:  # Resized (parameters added): the old one stays ours.
                self._scratch.setdefault("retired", []).append(self._scratch[name])
            self._scratch[name] = buf
            if name in ("state", "param"):
                self._scratch[name + "_words"] = buf.view(torch.int32)
        return self._scratch[name]

    def _of(self, p, which):
        """Parameter p's slice of one state tensor, as a tensor of its own: only p's elements
        are read (data-parallel: gathered from the ranks that own them, so every rank must
        call it), so reading every parameter's state one by one costs one read of the state."""
        for q, (o, n) in zip(self._params, self._slices):
            if q is p:
                break
        else:
            raise KeyError("not a parameter of this optimizer")
        handle = self._live()
        self._refresh_edited()
        if self._owned is None:
            out = torch.empty(n, dtype=torch.float32)
            check(lib.ckpt_optimizer_read_state_range(handle, which, o, out.data_ptr(), n))
            return out.view(p.shape)
        import torch.distributed as dist
        # This rank's pieces of p into a buffer of the largest parameter's size (kept: see
        # _reduced), zero elsewhere, then summed as int32 words across the ranks (each element
        # comes from the one rank that owns it).
        full = self._reduced("param", max(k for _, k in self._slices), torch.float32)
        full.zero_()
        for flat_at, local_at, k in self._owned:
            lo, hi = max(flat_at, o), min(flat_at + k, o + n)
            if lo >= hi:
                continue
            piece = torch.empty(hi - lo, dtype=torch.float32)
            check(lib.ckpt_optimizer_read_state_range(handle, which, local_at + lo - flat_at,
                                                      piece.data_ptr(), hi - lo))
            full[lo - o:hi - o].copy_(piece)
        dist.all_reduce(self._scratch["param_words"], group=self._group_handle)
        return full[:n].to("cpu", copy=True).view(p.shape)

    def master(self, p):
        """The FP32 master weights of parameter `p` (a copy)."""
        return self._of(p, _lib.MASTER)

    def exp_avg(self, p):
        return self._of(p, _lib.EXP_AVG)

    def exp_avg_sq(self, p):
        return self._of(p, _lib.EXP_AVG_SQ)

    def max_exp_avg_sq(self, p):
        """AMSGrad's running maximum of exp_avg_sq for `p` (zeros in a group without
        amsgrad); ValueError when no group ever had amsgrad."""
        if not self._max_slab:
            raise ValueError("no param group of this optimizer has amsgrad: there is no "
                             "max_exp_avg_sq")
        return self._of(p, _lib.MAX_EXP_AVG_SQ)

    def group_steps(self):
        """Each param group's AdamW step counter, as ckpt keeps it."""
        handle = self._live()
        out = []
        for gi in range(len(self.param_groups)):
            g = _lib.Group()
            check(lib.ckpt_optimizer_get_group(handle, gi, ctypes.byref(g)))
            out.append(g.step)
        return out

    def param_steps(self):
        """Each parameter's AdamW step count (how many steps updated it), in parameter order."""
        n = len(self._params)
        out = (ctypes.c_uint64 * n)()
        check(lib.ckpt_optimizer_param_steps(self._live(), out, n))
        return list(out)

    @property
    def lifecycle(self):
        value = ctypes.c_int()
        check(lib.ckpt_optimizer_lifecycle(self._live(), ctypes.byref(value)))
        return _lib.LIFECYCLE[value.value]

    def _pull_groups(self):
        """After a load: the checkpoint's hyper-parameters into param_groups."""
        for gi, g in enumerate(self.param_groups):
            c = _lib.Group()
            check(lib.ckpt_optimizer_get_group(self._live(), gi, ctypes.byref(c)))
            g["lr"], g["betas"], g["eps"], g["weight_decay"] = (
                c.lr, (c.beta1, c.beta2), c.eps, c.weight_decay)
            g["amsgrad"] = bool(c.amsgrad)
            if c.algorithm == _lib.MUON:
                g["momentum"], g["nesterov"] = c.momentum, bool(c.nesterov)
                g["ns_coefficients"] = (c.ns_a, c.ns_b, c.ns_c)
                g["ns_steps"] = c.ns_steps
                if c.adjust_lr == _lib.MUON_LR_MATCH_RMS_ADAMW:
                    g["adjust_lr_fn"] = "match_rms_adamw"
                elif g.get("adjust_lr_fn") == "match_rms_adamw":
                    g["adjust_lr_fn"] = None  # torch's default, "original".

    def _publish_weights(self):
        """After a load (which changes ckpt's masters only): the parameters become the masters
        rounded to their dtype, written in place (data-parallel: collective, the ranks exchange
        their pieces)."""
        handle = self._live()
        self.wait_for_step()  # A gated step's writes come first.
        self._state_changed()
        self._layout.pop("consolidated", None)
        if self._owned is None:
            # Into each parameter's own storage (non-contiguous ones through a copy); CUDA
            # parameters rounded on the device, ordered on the current stream.
            staged = [(p, p.detach().to(self._device).contiguous())
                      for p, home in zip(self._params, self._devices)
                      if home != self._device or not p.is_contiguous()]
            copies = {id(p): c for p, c in staged}
            n = len(self._params)
            ptrs = (ctypes.c_void_p * n)(*[copies[id(p)].data_ptr() if id(p) in copies
                                           else p.data_ptr() for p in self._params])
            if self._device.type == "cuda":
                stream = torch.cuda.current_stream(self._device).cuda_stream
                check(lib.ckpt_optimizer_write_piece_weights(handle, ptrs, n, 1, stream))
            else:
                check(lib.ckpt_optimizer_write_piece_weights(handle, ptrs, n, 0, None))
            with torch.no_grad():
                for p, c in staged:
                    p.detach().copy_(c)
            self._note_versions()
            return
        local = torch.empty(self._local_count, dtype=self._dtype)
        check(lib.ckpt_optimizer_write_weights(handle, local.data_ptr(), 0, None))
        self._exchange(local.to(self._device))
        self._local_params.copy_(local)
        self._scatter(self._flat)

    def close(self):
        """Frees ckpt's slabs (closing its checkpointers first: an async save in flight is
        abandoned); the optimizer refuses every call afterwards. Closing twice is harmless.
        Without close(), the slabs are freed when the last reference to the optimizer (or to
        a wrapper sharing its attributes) goes."""
        with _signals.deferred():
            run = getattr(self, "_ov", None)
            try:
                self.wait_for_step()  # A no-op without an open gate or once closed.
            finally:
                if run is not None:
                    run.gated = {}
                    _drop_gate_hook(run)
                    if run.native is not None:
                        self._drop_overlap()  # Its queued copies read gradients it holds.
                if self._native is not None:
                    self._native.close()

    def __deepcopy__(self, memo):
        raise TypeError("ckpt.torch.StagedAdamW keeps its state in native memory and cannot be "
                        "deep-copied; save it with ckpt.Checkpointer or state_dict()")

    def __reduce_ex__(self, protocol):
        raise TypeError("ckpt.torch.StagedAdamW keeps its state in native memory and cannot be "
                        "pickled; pickle its state_dict() instead")

    def _torch_state(self):
        """{id(param): {"step", "exp_avg", "exp_avg_sq", ["max_exp_avg_sq",] "master"}} for the
        parameters that have been stepped (torch keeps no state before a parameter's first
        step; max_exp_avg_sq in groups with amsgrad, as torch). Cached until the state
        changes."""
        if "torch_state" not in self._cache:
            steps = self.param_steps()
            master, m, v = (self._state(w) for w in (_lib.MASTER, _lib.EXP_AVG, _lib.EXP_AVG_SQ))
            x = self._state(_lib.MAX_EXP_AVG_SQ) if self._max_slab else None
            amsgrad = {id(p) for g in self.param_groups if g.get("amsgrad") for p in g["params"]}
            muon = self._muon_ids()
            out = {}
            for p, (o, n), step in zip(self._params, self._slices, steps):
                if step == 0:
                    continue
                if id(p) in muon:  # torch.optim.Muon's state, and ckpt's count and master.
                    out[id(p)] = {"step": torch.tensor(float(step)),
                                  "momentum_buffer": m[o:o + n].view(p.shape).clone(),
                                  "master": master[o:o + n].view(p.shape).clone()}
                    continue
                entry = {"step": torch.tensor(float(step)),
                         "exp_avg": m[o:o + n].view(p.shape).clone(),
                         "exp_avg_sq": v[o:o + n].view(p.shape).clone()}
                if x is not None and id(p) in amsgrad:
                    entry["max_exp_avg_sq"] = x[o:o + n].view(p.shape).clone()
                entry["master"] = master[o:o + n].view(p.shape).clone()
                out[id(p)] = entry
            self._cache["torch_state"] = out
        return self._cache["torch_state"]

    def _local_torch_state(self):
        """_torch_state's entries for this rank's pieces only (a process group): read from this
        rank's slabs, no collective; elements of a parameter owned elsewhere are zero. Cached
        until the state changes."""
        if "local_torch_state" not in self._cache:
            handle = self._live()
            self._refresh_edited()
            steps = self.param_steps()
            kinds = [("exp_avg", _lib.EXP_AVG), ("exp_avg_sq", _lib.EXP_AVG_SQ)]
            if self._max_slab:
                kinds.append(("max_exp_avg_sq", _lib.MAX_EXP_AVG_SQ))
            kinds.append(("master", _lib.MASTER))
            starts = [o for o, _ in self._slices]
            local = {}
            for name, which in kinds:
                flat = torch.empty(self._local_count, dtype=torch.float32)
                check(lib.ckpt_optimizer_read_state(handle, which, flat.data_ptr(),
                                                    flat.numel()))
                local[name] = flat
            amsgrad = {id(p) for g in self.param_groups if g.get("amsgrad") for p in g["params"]}
            muon = self._muon_ids()
            out, sources = {}, {}  # sources: id(p) -> (entry key, slab read into it).
            for flat_at, local_at, n in self._owned:
                if n == 0:
                    continue  # A parameter of no elements: nothing of it is this rank's.
                i = bisect.bisect_right(starts, flat_at) - 1
                p, o = self._params[i], self._slices[i][0]
                if steps[i] == 0:
                    continue
                if id(p) not in out:
                    sources[id(p)] = (("momentum_buffer", "exp_avg"), ("master", "master")) \
                        if id(p) in muon else \
                        [(key, key) for key, _ in kinds
                         if key != "max_exp_avg_sq" or id(p) in amsgrad]
                    out[id(p)] = {"step": torch.tensor(float(steps[i])),
                                  **{key: torch.zeros(p.shape) for key, _ in sources[id(p)]}}
                for key, source in sources[id(p)]:
                    at = flat_at - o
                    out[id(p)][key].view(-1)[at:at + n].copy_(local[source][local_at:local_at + n])
            self._cache["local_torch_state"] = out
        return self._cache["local_torch_state"]

    def _indexed_groups(self):
        """param_groups as a state dict has them: hyper-parameters, and the parameters'
        indices (numbered in group order, as torch numbers them)."""
        groups, index = [], 0
        for g in self.param_groups:
            n = len(g["params"])
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": list(range(index, index + n))})
            index += n
        return groups

    def _whole_state(self):
        """{index: entry} of every stepped parameter (data-parallel: collective)."""
        by_id = self._torch_state()
        return {i: {k: t.clone() for k, t in by_id[id(p)].items()}
                for i, p in enumerate(self._params) if id(p) in by_id}

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
        if self._owned is not None and "consolidated" in self._layout:
            to, state = self._layout["consolidated"]
            if state is None:
                raise RuntimeError(
                    f"StagedAdamW: the state was consolidated on rank {to} "
                    "(consolidate_state_dict): call state_dict() there, or local_state_dict() "
                    "for this rank's shard")
            return {"state": {i: {k: t.clone() for k, t in e.items()} for i, e in state.items()},
                    "param_groups": self._indexed_groups()}
        self._push_groups()
        return {"state": self._whole_state(), "param_groups": self._indexed_groups()}

    def consolidate_state_dict(self, to=0):
        """torch ZeroRedundancyOptimizer's convention (Lightning calls it before saving):
        collective; rank `to` of the process group then holds the whole state, which its
        state_dict() returns without a collective until the next step or load. Without a
        process group it does nothing (every state_dict() is whole)."""
        if self._owned is None or self._layout.get("state_store") is not None:
            return  # Whole already, or a reference (a trainer integration's): nothing to gather.
        import torch.distributed as dist
        self._push_groups()
        state = self._whole_state()
        self._cache.pop("torch_state", None)  # Only rank `to` keeps a whole copy.
        mine = dist.get_rank(self._group_handle) == to
        # Outside _cache (which an in-place edit seen on one rank clears): only a step, a load or
        # add_param_group, which every rank makes, drops it.
        self._layout["consolidated"] = (to, state if mine else None)

    def _shard_pieces(self):
        """This rank's pieces as (parameter index, first element, count, slab offset)."""
        owned = self._owned if self._owned is not None else [
            (o, o, n) for o, n in self._slices]
        starts = [o for o, _ in self._slices]
        out = []
        for flat_at, local_at, n in owned:
            i = bisect.bisect_right(starts, flat_at) - 1
            out.append((i, flat_at - starts[i], n, local_at))
        return out

    def local_state_dict(self):
        """This rank's shard, never collective: {"state": {index: {"step", "exp_avg",
        "exp_avg_sq", ["max_exp_avg_sq",] "master"}}, "param_groups": [...], "shard": {"rank",
        "world_size", "pieces": [[index, begin, count], ...], "param_steps": [...]}}, where each
        tensor is 1-D: the elements of that parameter this rank owns (its pieces, in order).
        load_state_dict() takes each rank's own shard back (all ranks at once: the weights are
        then exchanged). Without a process group the shard is the whole state, flat."""
        handle = self._push_groups()
        reads = [_lib.MASTER, _lib.EXP_AVG, _lib.EXP_AVG_SQ] + (
            [_lib.MAX_EXP_AVG_SQ] if self._max_slab else [])
        local = {}
        for which in reads:
            t = torch.empty(self._local_count, dtype=torch.float32)
            check(lib.ckpt_optimizer_read_state(handle, which, t.data_ptr(), t.numel()))
            local[which] = t
        steps = self.param_steps()
        amsgrad = {i for i, p in enumerate(self._params)
                   if any(g.get("amsgrad") and any(q is p for q in g["params"])
                          for g in self.param_groups)}
        pieces = self._shard_pieces()
        muon = self._muon_ids()
        state = {}
        for i in sorted({i for i, _, _, _ in pieces}):
            if steps[i] == 0:
                continue
            parts = [(at, n) for j, _, n, at in pieces if j == i]
            entry = {"step": torch.tensor(float(steps[i]))}
            kinds = ((("momentum_buffer", _lib.EXP_AVG), ("master", _lib.MASTER))
                     if id(self._params[i]) in muon else
                     (("exp_avg", _lib.EXP_AVG), ("exp_avg_sq", _lib.EXP_AVG_SQ),
                      ("max_exp_avg_sq", _lib.MAX_EXP_AVG_SQ), ("master", _lib.MASTER)))
            for key, which in kinds:
                if which in local and (key != "max_exp_avg_sq" or i in amsgrad):
                    entry[key] = torch.cat([local[which][at:at + n] for at, n in parts])
            state[i] = entry
        if self._owned is not None:
            import torch.distributed as dist
            rank, world = dist.get_rank(self._group_handle), dist.get_world_size(
                self._group_handle)
        else:
            rank, world = 0, 1
        return {"state": state, "param_groups": self._indexed_groups(),
                "shard": {"rank": rank, "world_size": world,
                          "pieces": [[i, b, n] for i, b, n, _ in pieces],
                          "param_steps": steps}}

    def load_state_dict(self, state_dict):
        """Loads a state dict of StagedAdamW's or torch.optim.AdamW's format, all or nothing:
        the hyper-parameters, the moments and step counters, and the masters ("master" when the
        dict has it, else the parameters' values widened to FP32); the parameters then become
        the masters rounded. A parameter without an entry starts fresh (moments zero, step 0).
        Raises ValueError naming what does not fit (groups, sizes, a non-finite value, a step
        that is not a count) with nothing changed.
        With a process group it is collective: every rank passes the whole dict, or each rank
        its own shard (local_state_dict()); a shard of another rank or layout is refused by
        every rank before anything changes."""
        handle = self._live()
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
            if state_dict.get("shard") is not None:
                arrays, steps = self._shard_arrays(state_dict["shard"], state)
            else:
                arrays, steps = self._whole_arrays(groups, state)
            names = ("master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
            for name, t in zip(names, arrays):
                if not torch.isfinite(t).all():
                    raise ValueError(f"the state dict's {name} holds a non-finite value")
        except Exception as e:  # Any refusal, on any rank, is every rank's (see below).
            error = e
        # Every rank refuses if any does: a rank that went on would wait forever for the others
        # in the weight exchange.
        if self._owned is not None and self._any_rank(error is not None) and error is None:
            error = ValueError("another rank refused the state dict (its error names why); "
                               "nothing was loaded")
        if error is not None:
            raise error
        step_array = (ctypes.c_uint64 * len(steps))(*steps)
        with _signals.deferred():
            # The state first: it is what can still be refused (an async save in flight); the
            # groups, validated above, then cannot be.
            check(lib.ckpt_optimizer_set_param_state(
                handle, arrays[0].data_ptr(), arrays[1].data_ptr(), arrays[2].data_ptr(),
                arrays[3].data_ptr() if self._max_slab else None,
                arrays[0].numel(), step_array, len(steps)))
            self._state_changed()
            for gi, (ours, group) in enumerate(zip(self.param_groups, new_groups)):
                ours.update({k: val for k, val in group.items() if k != "params"})
                check(lib.ckpt_optimizer_set_group(handle, gi, ctypes.byref(self._group(ours))))
            self._publish_weights()

    def _take_hyper_parameters(self, groups):
        """A state dict's param_groups (their hyper-parameters, validated as load_state_dict
        validates them) into param_groups; ckpt takes them at the next step."""
        if groups is None:
            return
        for ours, group in zip(self.param_groups, self._merged_groups(groups)):
            ours.update({k: v for k, v in group.items() if k != "params"})

    def _merged_groups(self, groups):
        """This optimizer's param groups with a state dict's hyper-parameters, validated."""
        if len(groups) != len(self.param_groups):
            raise ValueError(f"the state dict has {len(groups)} param groups, this optimizer "
                             f"{len(self.param_groups)}")
        new_groups = []
        for gi, (ours, theirs) in enumerate(zip(self.param_groups, groups)):
            if len(theirs.get("params", ())) != len(ours["params"]):
                raise ValueError(f"param group {gi} has {len(theirs.get('params', ()))} "
                                 f"parameters in the state dict, {len(ours['params'])} here")
            group = {**ours, **{k: val for k, val in theirs.items() if k != "params"}}
            if bool(group.get("use_muon")) != bool(ours.get("use_muon")):
                raise ValueError(
                    f"param group {gi} is {'Muon' if theirs.get('use_muon') else 'AdamW'}'s in "
                    f"the state dict and {'Muon' if ours.get('use_muon') else 'AdamW'}'s here: a "
                    "group's algorithm is fixed when it is added")
            self._check_group(group, gi)
            new_groups.append(group)
        if not self._max_slab and any(g.get("amsgrad") for g in new_groups):
            raise ValueError("the state dict's param groups use amsgrad, and this optimizer keeps "
                             "no max_exp_avg_sq: build it with amsgrad=True in those groups")
        return new_groups

    @staticmethod
    def _entry_step(entry, name):
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

    def _whole_arrays(self, groups, state):
        """A whole state dict as this rank's (master, exp_avg, exp_avg_sq, max_exp_avg_sq) in
        slab order, and every parameter's step count."""
        total = self._total
        master = torch.empty(total, dtype=torch.float32)
        m = torch.zeros(total, dtype=torch.float32)
        v = torch.zeros(total, dtype=torch.float32)
        x = torch.zeros(total, dtype=torch.float32)  # AMSGrad's maximum (zero where absent).
        slice_of = {id(p): s for p, s in zip(self._params, self._slices)}
        steps = [0] * len(self._params)
        index_of = {id(p): i for i, p in enumerate(self._params)}
        muon = self._muon_ids()
        for ours, theirs in zip(self.param_groups, groups):
            # As torch: the dict's state is keyed by the ids its param_groups list.
            for p, saved_id in zip(ours["params"], theirs["params"]):
                name = self._name_of(p)
                o, n = slice_of[id(p)]
                with torch.no_grad():
                    master[o:o + n].copy_(p.detach().reshape(-1).float().cpu())
                entry = state.get(saved_id)
                if not entry:
                    continue
                kinds = ((("momentum_buffer", m), ("master", master)) if id(p) in muon else
                         (("exp_avg", m), ("exp_avg_sq", v), ("max_exp_avg_sq", x),
                          ("master", master)))
                for key, dest in kinds:
                    if key not in entry:
                        if key in ("master", "max_exp_avg_sq"):
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
                    dest[o:o + n].copy_(t.reshape(-1).float().cpu())
                # torch's Muon counts no steps: a parameter with a momentum buffer has taken one.
                steps[index_of[id(p)]] = self._entry_step(
                    entry if id(p) not in muon or "step" in entry else {"step": 1}, name)
        return [self._local_of(t) for t in (master, m, v, x)], steps

    def _shard_arrays(self, shard, state):
        """This rank's own shard (local_state_dict()) as its slab arrays and the step counts;
        ValueError, on every rank alike, for a shard of another rank or layout."""
        pieces = self._shard_pieces()
        if self._owned is not None:
            import torch.distributed as dist
            rank, world = dist.get_rank(self._group_handle), dist.get_world_size(
                self._group_handle)
        else:
            rank, world = 0, 1
        theirs = [list(map(int, q)) for q in shard.get("pieces", ())]
        if (shard.get("world_size") != world or shard.get("rank") != rank or
                theirs != [[i, b, n] for i, b, n, _ in pieces]):
            raise ValueError(f"the state dict is the shard of rank {shard.get('rank')} of "
                             f"{shard.get('world_size')}, and this is rank {rank} of {world}, "
                             "which owns other pieces: each rank loads its own shard, saved at "
                             "this layout; at another world size load a whole state dict "
                             "(consolidate_state_dict) or use ckpt.Checkpointer")
        steps = shard.get("param_steps")
        if not isinstance(steps, (list, tuple)) or len(steps) != len(self._params):
            raise ValueError("the shard's param_steps do not list every parameter")
        steps = [self._entry_step({"step": s}, self._names[i]) for i, s in enumerate(steps)]
        local = self._local_count
        flat = torch.cat([p.detach().reshape(-1).float().cpu() for p in self._params])
        master = self._local_of(flat).clone()
        m, v, x = (torch.zeros(local, dtype=torch.float32) for _ in range(3))
        muon = self._muon_ids()
        for i in {i for i, _, _, _ in pieces}:
            entry = state.get(i)
            if not entry:
                continue
            parts = [(at, n) for j, _, n, at in pieces if j == i]
            count = sum(n for _, n in parts)
            kinds = ((("momentum_buffer", m), ("master", master)) if id(self._params[i]) in muon
                     else (("exp_avg", m), ("exp_avg_sq", v), ("max_exp_avg_sq", x),
                           ("master", master)))
            for key, dest in kinds:
                if key not in entry:
                    if key in ("master", "max_exp_avg_sq"):
                        continue
                    raise ValueError(f"the shard of parameter {self._names[i]} has no {key}")
                t = torch.as_tensor(entry[key]).detach().reshape(-1).float().cpu()
                if t.numel() != count:
                    raise ValueError(f"{key} of parameter {self._names[i]} has {t.numel()} "
                                     f"elements in the shard, this rank owns {count}")
                done = 0
                for at, n in parts:
                    dest[at:at + n].copy_(t[done:done + n])
                    done += n
        return [master, m, v, x], steps

    def _name_of(self, param):
        for p, name in zip(self._params, self._names):
            if p is param:
                return name
        raise KeyError("not a parameter of this optimizer")

    def _local_of(self, full, dtype=torch.float32):
        """This rank's elements of a full flat CPU tensor, in slab order."""
        if self._owned is None:
            return full.contiguous()
        local = torch.empty(self._local_count, dtype=dtype)
        for flat_at, local_at, n in self._owned:
            local[local_at:local_at + n].copy_(full[flat_at:flat_at + n])
        return local


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
    """

    _min_capability = 8

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=(3.4445, -4.775, 2.0315), eps=1e-7, ns_steps=5,
                 adjust_lr_fn=None, *, adamw_lr=None, adamw_betas=(0.9, 0.999), adamw_eps=1e-8,
                 adamw_weight_decay=None, moments="f32", threads=0, unit_bytes=0,
                 process_group=None, bucket_elems=0, reduce_grads=True, engine="auto"):
        self._muon_defaults = dict(
            use_muon=True, momentum=momentum, nesterov=bool(nesterov),
            ns_coefficients=tuple(ns_coefficients) if isinstance(ns_coefficients, (tuple, list))
            else ns_coefficients, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        _check_muon_group(self._muon_defaults)
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
