"""The parameters as ckpt sees them: what the constructor and add_param_group accept (tensors,
(name, tensor) pairs, group dicts of either), and the table of each parameter's place in ckpt's
flat order, with what ckpt last wrote into it (to tell an edit by the trainer at the next step).
"""
import ctypes

import torch

from .. import _lib
from .._lib import CkptError, Code

_DTYPES = {torch.float32: _lib.F32, torch.bfloat16: _lib.BF16, torch.float16: _lib.F16}


def _is_number(value):
    """An int or float (not a bool), or a one-element tensor (torch accepts a tensor lr)."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and value.is_floating_point()
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _seen_of(p):
    """What ckpt remembers of a parameter it wrote, to tell an edit by the trainer at the next
    step: its version counter, storage and shape (`.data` set to a view of it changes neither
    of the others)."""
    return p._version, p.data_ptr(), p.shape


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


def _checked_params(groups, check_group):
    """Every parameter of torch's param groups, checked: a tensor, once, of a dtype and on a
    device ckpt steps, in a group `check_group(group, index)` accepts."""
    params = [p for g in groups for p in g["params"]]
    if not params:
        raise ValueError("StagedAdamW got no parameters")
    for p in params:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"parameters must be tensors, got {type(p).__name__}")
    if len({id(p) for p in params}) != len(params):
        raise ValueError("a parameter appears twice")
    for gi, g in enumerate(groups):
        check_group(g, gi)
    _check_kinds(params)
    return params


def _check_kinds(params):
    """Each parameter of a dtype and on a device ckpt steps (TypeError naming the first that is
    not)."""
    for p in params:
        if p.dtype not in _DTYPES:
            raise TypeError(f"parameters must be float32, bfloat16 or float16, got {p.dtype}")
        if p.device.type not in ("cpu", "cuda"):
            raise TypeError(f"parameters on {p.device} are not supported (CPU or CUDA)")


def _one_cuda(devices):
    """The CUDA devices among these, at most one (TypeError otherwise)."""
    cuda = {d for d in devices if d.type == "cuda"}
    if len(cuda) > 1:
        raise TypeError(f"parameters on several CUDA devices ({sorted(map(str, cuda))}): "
                        "one optimizer serves one GPU (and the CPU)")
    return cuda


def _engine_device(params, cuda, engine, min_capability, owner):
    """Where the engine runs: where most of the elements are (CUDA parameters with a few CPU
    ones, or the reverse, share one optimizer; the others are staged through copies), unless
    `engine` says; the CPU when the GPU's compute capability is below `min_capability` (what
    the algorithm of `owner`, a class name for messages, needs)."""
    on_cuda = sum(p.numel() for p in params if p.device.type == "cuda")
    device = next(iter(cuda)) if on_cuda * 2 > sum(p.numel() for p in params) else \
        torch.device("cpu")
    if engine == "cpu":
        device = torch.device("cpu")  # CUDA parameters staged through host copies.
    elif engine == "cuda" and device.type != "cuda":
        if not cuda:
            raise ValueError("engine='cuda' needs parameters on a CUDA device")
        device = next(iter(cuda))
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if capability is not None and capability[0] < min_capability:
        if engine == "cuda":
            raise ValueError(f"engine='cuda' needs compute capability {min_capability} or "
                             f"newer for {owner}; {device} has {capability}: use "
                             "engine='auto'")
        # StagedMuon on a GPU without BF16 tensor cores: the CPU engine, the CUDA parameters
        # staged through host copies.
        device = torch.device("cpu")
    return device


def _stream_of(device):
    """The current stream of the engine's device as ckpt's calls take it (None on the CPU)."""
    if device.type == "cuda":
        return torch.cuda.current_stream(device).cuda_stream
    return None


class _ParamTable:
    """The optimizer's parameters in ckpt's flat order: each one's name, dtype, shape and device
    as ckpt was told them, its (offset, count) in the flat order, and what it was when ckpt last
    wrote it (_seen_of). Each parameter keeps its own storage: ckpt reads its gradient and writes
    it in place. One object, made by the optimizer and grown (in place) by add_param_group, so
    that wrappers which copy the optimizer's __dict__ see the same table. Not thread-safe: the
    optimizer's calls, one at a time."""

    def __init__(self):
        self.params, self.names, self.dtypes, self.shapes, self.devices = [], [], [], [], []
        self.slices = []  # (offset, count) of each parameter in ckpt's flat order.
        self.seen = []  # _seen_of each parameter as ckpt last wrote it.
        self.total = 0  # The elements of all parameters.
        # The parameters' common dtype (None when they mix), and the step's gradient dtype.
        self.dtype = None
        self.grad_dtype = None

    def describe(self, new, names, groups):
        """New parameters' names (given, or param.<index>) and their ckpt_param specs, with
        `groups` their group indices; ValueError when a name repeats. Changes nothing."""
        first = len(self.params)
        new_names = [names.get(id(p), f"param.{first + i}") for i, p in enumerate(new)]
        if len(set(new_names) | set(self.names)) != len(new_names) + len(self.names):
            raise ValueError("parameter names repeat")
        encoded = [_lib.encode_text(n, "parameter name") for n in new_names]
        shapes = [(ctypes.c_uint64 * max(1, p.dim()))(*p.shape) for p in new]
        specs = (_lib.Param * len(new))(*[
            _lib.Param(encoded[i], shapes[i], new[i].dim(), _DTYPES[new[i].dtype], groups[i])
            for i in range(len(new))])
        return new_names, specs

    def extend(self, new, new_names):
        """New parameters (described, and taken by ckpt) at the end of the table, in place."""
        for p in new:
            self.slices.append((self.total, p.numel()))
            self.total += p.numel()
        self.params.extend(new)
        self.names.extend(new_names)
        self.dtypes.extend(p.dtype for p in new)
        self.shapes.extend(tuple(p.shape) for p in new)  # As checkpoints record them.
        self.devices.extend(p.device for p in new)
        self.seen.extend(_seen_of(p) for p in new)

    def index(self, param):
        """The index of a parameter of this table (KeyError for another tensor)."""
        for i, p in enumerate(self.params):
            if p is param:
                return i
        raise KeyError("not a parameter of this optimizer")

    def edited(self):
        """(what each parameter is now, the indices of those the trainer changed since ckpt
        last wrote them), each edited one checked (check_unchanged) before anything is read."""
        now = [_seen_of(p) for p in self.params]
        if now == self.seen:
            return now, []
        edited = [i for i, (a, b) in enumerate(zip(now, self.seen)) if a != b]
        # A parameter that now has another dtype, device or size is refused before anything
        # is read from it.
        self.check_unchanged(edited)
        return now, edited

    def note_versions(self):
        """What each parameter is now (_seen_of), so that the next step can tell which ones the
        trainer changed in place."""
        self.seen[:] = [_seen_of(p) for p in self.params]

    def check_unchanged(self, indices):
        """Each of these parameters still of the dtype, device and shape ckpt reads and writes
        and its checkpoints record (CkptError naming the first that is not; torch's AdamW fails
        on a reshaped parameter too). Run on the parameters whose version or storage changed:
        nothing else changes a parameter's dtype, device or shape."""
        for i in indices:
            p, name, dtype, shape = self.params[i], self.names[i], self.dtypes[i], self.shapes[i]
            if p.dtype != dtype or p.device != self.devices[i] or tuple(p.shape) != shape:
                raise CkptError(Code.FAILED_PRECONDITION,
                                f"parameter {name} changed: {p.dtype} on {p.device}, shape "
                                f"{list(p.shape)} (built with {dtype} on "
                                f"{self.devices[i]}, shape {list(shape)})")
