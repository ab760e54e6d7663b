"""ckpt.torch.StagedAdamW: ckpt's AdamW as a torch.optim.Optimizer.

FP32 master weights and both moments live in ckpt's host slabs (not in `state`); each `step()`
copies the gradients into one flat buffer and hands it to ckpt (the CPU engine on every core, or
the CUDA engine streaming units through bounded GPU buffers on the current stream), which
writes the updated weights, rounded to the parameters' dtype, straight into the parameters:
they are views of one contiguous buffer in ckpt's order. `param_groups` stay mutable as in
torch, so torch.optim.lr_scheduler schedulers work unchanged; hyper-parameters are read at each
step. Checkpoints go through ckpt.Checkpointer (transactions, async save, rollback, resharding).
"""
import ctypes

import torch

from . import _lib, _signals
from ._lib import CkptError, check, lib
from ._native import Native

_DTYPES = {torch.float32: _lib.F32, torch.bfloat16: _lib.BF16, torch.float16: _lib.F16}
_MOMENTS = {"f32": _lib.MOMENTS_F32, "bf16": _lib.MOMENTS_BF16}


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


class StagedAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, as torch.optim.AdamW) with ckpt's staged state.

    params: tensors, (name, tensor) pairs (names become the checkpoint's tensor names, e.g.
      `model.named_parameters()`, as HuggingFace names them), or param-group dicts of either.
      All of one dtype (float32, bfloat16, float16) and one device (CPU, or one CUDA device).
    moments: "f32" (default) or "bf16" (moments rounded to BF16 in the slabs).
    threads: CPU engine threads (0: every core). unit_bytes: ckpt's unit size (0: default).
    process_group: a torch.distributed group (e.g. torch.distributed.group.WORLD) over which the
      state is sharded ZeRO-1 style: each rank owns the pieces Megatron's buckets of
      `bucket_elems` elements (0: 40M) give it, steps only those, and the ranks then exchange
      the updated parameters; with reduce_grads the gradients are first averaged over the
      group in FP32 (leave it off when DDP already averaged them).
    A parameter whose .grad is None is stepped with a zero gradient (its weight decay applies).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *,
                 moments="f32", threads=0, unit_bytes=0, process_group=None, bucket_elems=0,
                 reduce_grads=True):
        for key, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{key} must be a number >= 0, got {value!r}")
        if (not isinstance(betas, (tuple, list)) or len(betas) != 2 or
                not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas)):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
        if moments not in _MOMENTS:
            raise ValueError(f"moments must be 'f32' or 'bf16', got {moments!r}")
        for key, value in (("threads", threads), ("unit_bytes", unit_bytes),
                           ("bucket_elems", bucket_elems)):
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2 ** 63:
                raise ValueError(f"{key} must be an int >= 0, got {value!r}")
        params, names = _named(params)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay))
        self._native = None
        plist = [p for g in self.param_groups for p in g["params"]]
        if not plist:
            raise ValueError("StagedAdamW got no parameters")
        for p in plist:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"parameters must be tensors, got {type(p).__name__}")
        if len({id(p) for p in plist}) != len(plist):
            raise ValueError("a parameter appears twice")
        for g in self.param_groups:
            for key in ("lr", "eps", "weight_decay"):
                v = g[key]
                if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0 or \
                        v == float("inf"):
                    raise ValueError(f"{key} must be a finite number >= 0, got {v!r}")
        dtype, device = plist[0].dtype, plist[0].device
        if dtype not in _DTYPES:
            raise TypeError(f"parameters must be float32, bfloat16 or float16, got {dtype}")
        for p in plist:
            if p.dtype != dtype or p.device != device:
                raise TypeError(f"all parameters must share one dtype and device: {p.dtype} on "
                                f"{p.device} beside {dtype} on {device}")
        if device.type not in ("cpu", "cuda"):
            raise TypeError(f"parameters on {device} are not supported (CPU or CUDA)")
        self._dtype, self._device = dtype, device
        self._params = plist
        self._names = [names.get(id(p), f"param.{i}") for i, p in enumerate(plist)]
        if len(set(self._names)) != len(self._names):
            raise ValueError("parameter names repeat")
        encoded = [_lib.encode_text(n, "parameter name") for n in self._names]
        group_of = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        # One contiguous buffer in ckpt's order; each parameter becomes a view of its slice.
        total = sum(p.numel() for p in plist)
        self._slices = []
        flat = torch.empty(total, dtype=dtype, device=device)
        at = 0
        with torch.no_grad():
            for p in plist:
                n = p.numel()
                flat[at:at + n].copy_(p.detach().reshape(-1))
                self._slices.append((at, n))
                at += n
            for p, (o, n) in zip(plist, self._slices):
                p.data = flat[o:o + n].view(p.shape)
        self._flat = flat
        # Data-parallel gradients are averaged in FP32 (gloo cannot all-reduce BF16, and a sum
        # in F16 overflows where the mean would not); ckpt's step takes FP32 gradients too.
        grad_dtype = torch.float32 if process_group is not None else dtype
        self._grads = torch.zeros(total, dtype=grad_dtype, device=device)
        shapes = [(ctypes.c_uint64 * max(1, p.dim()))(*p.shape) for p in plist]
        specs = (_lib.Param * len(plist))(*[
            _lib.Param(encoded[i], shapes[i], plist[i].dim(), _DTYPES[dtype],
                       group_of[id(plist[i])]) for i in range(len(plist))])
        groups = (_lib.Group * len(self.param_groups))(*[self._group(g) for g in self.param_groups])
        self._group_handle = process_group
        self._reduce_grads = reduce_grads
        if process_group is not None:
            import torch.distributed as dist
            rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
            count = ctypes.c_size_t()
            check(lib.ckpt_rank_pieces(specs, len(plist), bucket_elems, world, rank, None, 0,
                                       ctypes.byref(count)))
            pieces = (_lib.Piece * max(1, count.value))()
            check(lib.ckpt_rank_pieces(specs, len(plist), bucket_elems, world, rank, pieces,
                                       count.value, ctypes.byref(count)))
            npieces = count.value
            # (offset in the flat parameters, offset in this rank's slabs, count) per piece.
            self._owned = []
            at = 0
            for i in range(npieces):
                q = pieces[i]
                self._owned.append((self._slices[q.param][0] + q.begin, at, q.count))
                at += q.count
            local = at
        else:
            pieces = (_lib.Piece * len(plist))(*[_lib.Piece(i, 0, n) for i, (_, n) in
                                                 enumerate(self._slices)])
            npieces = len(plist)
            self._owned = None
            local = total
        # This rank's elements in slab order: the weights ckpt steps and its checkpointer reads
        # and loads into (the parameters themselves for one CPU process), and their gradients.
        if self._owned is None and device.type == "cpu":
            self._host = flat
        else:
            self._host = torch.empty(local, dtype=dtype, pin_memory=device.type == "cuda")
            self._gather(flat, self._host)
        self._local_grads = self._grads if self._owned is None else torch.empty(
            local, dtype=grad_dtype, device=device)
        self._local_params = flat if self._owned is None else torch.empty(
            local, dtype=dtype, device=device)
        options = _lib.OptimizerOptions(
            _lib.ENGINE_CUDA if device.type == "cuda" else _lib.ENGINE_CPU, unit_bytes, threads, 0,
            _MOMENTS[moments])
        handle = ctypes.c_void_p()
        check(lib.ckpt_optimizer_create(specs, len(plist), groups, len(self.param_groups), pieces,
                                        npieces, ctypes.byref(options),
                                        self._host.data_ptr(), self._host.numel() * self._host.element_size(),
                                        ctypes.byref(handle)))
        self._host_ptr = self._host.data_ptr()
        # The one owner of the handle (ckpt/_native.py): wrappers that copy this object's
        # __dict__ share it, and it is freed when the last of them goes, or by close().
        self._native = Native(handle, lib.ckpt_optimizer_destroy, "optimizer")

    @staticmethod
    def _group(g):
        b1, b2 = g["betas"]
        return _lib.Group(float(g["lr"]), float(b1), float(b2), float(g["eps"]),
                          float(g["weight_decay"]), 0)

    def _live(self):
        if self._native is None:
            raise CkptError(9, "the optimizer is closed")
        handle = self._native.handle
        if self._host.data_ptr() != self._host_ptr:
            raise CkptError(9, "the parameters' buffer moved (model.share_memory(), .to(), ...): "
                               "ckpt still points at the old one; build the optimizer after "
                               "moving the model")
        return handle

    def add_param_group(self, param_group):
        if getattr(self, "_native", None) is not None:
            raise NotImplementedError("StagedAdamW's parameters are fixed at construction: "
                                      "build it with every group")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        handle = self._push_groups()
        for p, (o, n) in zip(self._params, self._slices):
            if p.data_ptr() != self._flat[o:o + n].data_ptr():
                raise CkptError(9, f"parameter {self._names[self._params.index(p)]} no longer "
                                   "views the optimizer's buffer (was .data replaced?)")
            if p.grad is None:
                self._grads[o:o + n].zero_()
            else:
                self._grads[o:o + n].copy_(p.grad.reshape(-1))
        if self._owned is not None:
            import torch.distributed as dist
            if self._reduce_grads:
                dist.all_reduce(self._grads, group=self._group_handle)
                self._grads.div_(dist.get_world_size(self._group_handle))
            self._gather(self._grads, self._local_grads)
        stream = None
        if self._device.type == "cuda":
            stream = torch.cuda.current_stream(self._device).cuda_stream
        skipped = ctypes.c_int(0)
        check(lib.ckpt_optimizer_step(handle, self._local_grads.data_ptr(),
                                      _DTYPES[self._local_grads.dtype],
                                      1.0, self._local_params.data_ptr(), 0, stream,
                                      ctypes.byref(skipped)))
        if self._owned is not None:
            self._exchange(self._local_params)
        return loss

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
        words = torch.zeros((nbytes + 3) // 4, dtype=torch.int32, device=self._flat.device)
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
            check(lib.ckpt_optimizer_set_group(handle, gi, ctypes.byref(self._group(g))))
        return handle

    def _state(self, which):
        """One state tensor over every parameter (data-parallel: gathered from the ranks, so
        every rank must call it)."""
        handle = self._live()
        local = torch.empty(self._host.numel(), dtype=torch.float32)
        check(lib.ckpt_optimizer_read_state(handle, which, local.data_ptr(), local.numel()))
        if self._owned is None:
            return local
        import torch.distributed as dist
        # On the parameters' device: NCCL reduces device tensors only.
        full = torch.zeros(self._flat.numel(), dtype=torch.float32, device=self._flat.device)
        for flat_at, local_at, n in self._owned:
            full[flat_at:flat_at + n].copy_(local[local_at:local_at + n])
        dist.all_reduce(full.view(torch.int32), group=self._group_handle)
        return full.cpu()

    def _of(self, p, which):
        for q, (o, n) in zip(self._params, self._slices):
            if q is p:
                return self._state(which)[o:o + n].view(p.shape)
        raise KeyError("not a parameter of this optimizer")

    def master(self, p):
        """The FP32 master weights of parameter `p` (a copy)."""
        return self._of(p, _lib.MASTER)

    def exp_avg(self, p):
        return self._of(p, _lib.EXP_AVG)

    def exp_avg_sq(self, p):
        return self._of(p, _lib.EXP_AVG_SQ)

    def group_steps(self):
        """Each param group's AdamW step counter, as ckpt keeps it."""
        handle = self._live()
        out = []
        for gi in range(len(self.param_groups)):
            g = _lib.Group()
            check(lib.ckpt_optimizer_get_group(handle, gi, ctypes.byref(g)))
            out.append(g.step)
        return out

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

    def _publish_weights(self):
        """After a load (which changes ckpt's masters only): the parameters become the masters
        rounded to their dtype (data-parallel: collective, the ranks exchange their pieces)."""
        handle = self._live()
        if self._owned is None and self._device.type == "cuda":
            # Straight into the parameters on the device, ordered on the current stream.
            stream = torch.cuda.current_stream(self._device).cuda_stream
            check(lib.ckpt_optimizer_write_weights(handle, self._flat.data_ptr(), 1, stream))
            return
        check(lib.ckpt_optimizer_write_weights(handle, self._host.data_ptr(), 0, None))
        if self._owned is not None:
            self._exchange(self._host.to(self._device))
            self._local_params.copy_(self._host)
        elif self._host is not self._flat:
            self._flat.copy_(self._host)

    def close(self):
        """Frees ckpt's slabs (closing its checkpointers first: an async save in flight is
        abandoned); the optimizer refuses every call afterwards. Closing twice is harmless.
        Without close(), the slabs are freed when the last reference to the optimizer (or to
        a wrapper sharing its attributes) goes."""
        with _signals.deferred():
            if self._native is not None:
                self._native.close()

    def __deepcopy__(self, memo):
        raise TypeError("ckpt.torch.StagedAdamW keeps its state in native memory and cannot be "
                        "deep-copied; save it with ckpt.Checkpointer or state_dict()")

    def __reduce_ex__(self, protocol):
        raise TypeError("ckpt.torch.StagedAdamW keeps its state in native memory and cannot be "
                        "pickled; pickle its state_dict() instead")

    def state_dict(self):
        raise NotImplementedError("StagedAdamW's state lives in ckpt: save it with "
                                  "ckpt.Checkpointer(root, optimizer).save(step)")

    def load_state_dict(self, state_dict):
        raise NotImplementedError("load StagedAdamW's state with ckpt.Checkpointer.load()")
