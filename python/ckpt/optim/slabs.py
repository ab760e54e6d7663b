"""ckpt's state of one optimizer as the façade reads and writes it: its slabs (FP32 masters and
the algorithm's state tensors, this rank's elements in slab order), each parameter's step
count, each group's native hyper-parameters, and the weights ckpt writes back after a load.
"""
import ctypes

import torch

from .. import _lib
from .._lib import check, lib
from .._native import Native
from .mirror import _weights_on_host

_MOMENTS = {"f32": _lib.MOMENTS_F32, "bf16": _lib.MOMENTS_BF16}


def _check_options(moments, engine, threads, unit_bytes, bucket_elems):
    """The native optimizer's options, as the constructor takes them (ValueError naming the
    first that is not valid)."""
    if moments not in _MOMENTS:
        raise ValueError(f"moments must be 'f32' or 'bf16', got {moments!r}")
    if engine not in ("auto", "cpu", "cuda"):
        raise ValueError(f"engine must be 'auto', 'cpu' or 'cuda', got {engine!r}")
    for key, value in (("threads", threads), ("unit_bytes", unit_bytes),
                       ("bucket_elems", bucket_elems)):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2 ** 63:
            raise ValueError(f"{key} must be an int >= 0, got {value!r}")


class _Slabs:
    """Typed reads and writes of one ckpt optimizer through its native handle. The optimizer
    owns the handle (a Native) and its parameter table and sharding; this borrows all three:
    every call refuses (CkptError, FAILED_PRECONDITION) once the handle is closed, and with a
    sharding the reads of whole tensors and the weights' write-back are collective (every rank
    at the same point). Shared by wrappers that copy the optimizer's __dict__. Not thread-safe:
    the optimizer's calls, one at a time."""

    def __init__(self, native, table, shards):
        self.native, self.table, self.shards = native, table, shards

    @classmethod
    def create(cls, table, shards, specs, groups, device, moments, threads, unit_bytes):
        """ckpt's optimizer over the table's parameters (`specs`; with `shards` this rank's
        pieces of them), with `groups` (ctypes _lib.Group) its param groups; the engine runs on
        `device`. The masters start from the parameters' weights."""
        if shards is not None:
            pieces, npieces = shards.pieces, shards.npieces
        else:
            npieces = len(table.params)
            pieces = (_lib.Piece * npieces)(*[_lib.Piece(i, 0, n) for i, (_, n) in
                                              enumerate(table.slices)])
        options = _lib.OptimizerOptions(
            _lib.ENGINE_CUDA if device.type == "cuda" else _lib.ENGINE_CPU, unit_bytes, threads,
            0, _MOMENTS[moments])
        # This rank's weights in slab order, in host memory: the masters start from them.
        full = _weights_on_host(table.params, table.dtype)
        host = full
        if table.dtype is not None:
            host = shards.local_of(full, table.dtype) if shards is not None else full.contiguous()
        handle = ctypes.c_void_p()
        check(lib.ckpt_optimizer_create(specs, len(table.params), groups, len(groups), pieces,
                                        npieces, ctypes.byref(options), host.data_ptr(),
                                        host.numel() * host.element_size(),
                                        ctypes.byref(handle)))
        del full, host
        # The one owner of the handle (ckpt/_native.py): wrappers that copy the optimizer's
        # __dict__ share it, and it is freed when the last of them goes, or by close().
        return cls(Native(handle, lib.ckpt_optimizer_destroy, "optimizer"), table, shards)

    def add(self, new, specs, group):
        """New parameters (`specs`, one param group's: `group`, a _lib.Group) into ckpt's
        slabs, after the table's, starting fresh (the table grows once ckpt has them)."""
        first = len(self.table.params)
        pieces = (_lib.Piece * len(new))(*[_lib.Piece(first + i, 0, p.numel())
                                           for i, p in enumerate(new)])
        host = _weights_on_host(new, None)  # The new pieces' own flat weight buffer.
        check(lib.ckpt_optimizer_add_params(self.handle, specs, len(new), ctypes.byref(group), 1,
                                            pieces, len(new), host.data_ptr(), host.numel()))

    @property
    def handle(self):
        return self.native.handle

    @property
    def count(self):
        """The elements of this rank's slabs."""
        return self.shards.local if self.shards is not None else self.table.total

    def local(self, which):
        """This rank's elements of one state tensor, in slab order (no collective)."""
        out = torch.empty(self.count, dtype=torch.float32)
        check(lib.ckpt_optimizer_read_state(self.handle, which, out.data_ptr(), out.numel()))
        return out

    def whole(self, which):
        """One state tensor over every parameter, flat (sharded: gathered from the ranks)."""
        local = self.local(which)
        return local if self.shards is None else self.shards.whole(local)

    def param(self, index, which):
        """Parameter `index`'s elements of one state tensor, flat, and only those read
        (sharded: gathered from the ranks that own them)."""
        handle = self.handle
        o, n = self.table.slices[index]

        def read(at, count):
            out = torch.empty(count, dtype=torch.float32)
            check(lib.ckpt_optimizer_read_state_range(handle, which, at, out.data_ptr(), count))
            return out
        if self.shards is None:
            return read(o, n)
        return self.shards.whole_range(o, n, read)

    def steps(self):
        """Each parameter's step count, in parameter order."""
        n = len(self.table.params)
        out = (ctypes.c_uint64 * n)()
        check(lib.ckpt_optimizer_param_steps(self.handle, out, n))
        return list(out)

    def group(self, index):
        """Param group `index`'s hyper-parameters and step counter, as ckpt keeps them."""
        c = _lib.Group()
        check(lib.ckpt_optimizer_get_group(self.handle, index, ctypes.byref(c)))
        return c

    def set_group(self, index, c):
        """Param group `index`'s hyper-parameters (a _lib.Group) into ckpt."""
        check(lib.ckpt_optimizer_set_group(self.handle, index, ctypes.byref(c)))

    def lifecycle(self):
        value = ctypes.c_int()
        check(lib.ckpt_optimizer_lifecycle(self.handle, ctypes.byref(value)))
        return _lib.LIFECYCLE[value.value]

    def set_masters(self, index, values):
        """Parameter `index`'s masters (this rank's elements of them) from `values`, all of its
        elements as a flat FP32 CPU tensor."""
        o, count = self.table.slices[index]
        if self.shards is None:
            check(lib.ckpt_optimizer_set_masters(self.handle, o, values.data_ptr(), count))
            return
        for local_at, at, k in self.shards.parts(o, count):
            part = values[at:at + k].contiguous()
            check(lib.ckpt_optimizer_set_masters(self.handle, local_at, part.data_ptr(), k))

    def set_state(self, arrays, steps, with_max, aux=None):
        """Every slab of this rank (`arrays`: master, exp_avg, exp_avg_sq, max_exp_avg_sq, the
        last only `with_max`; `aux`: the aux slab, or None for an optimizer without one) and
        every parameter's step count, at once."""
        step_array = (ctypes.c_uint64 * len(steps))(*steps)
        if aux is None:
            check(lib.ckpt_optimizer_set_param_state(
                self.handle, arrays[0].data_ptr(), arrays[1].data_ptr(), arrays[2].data_ptr(),
                arrays[3].data_ptr() if with_max else None, arrays[0].numel(), step_array,
                len(steps)))
            return
        state = _lib.State(ctypes.sizeof(_lib.State), arrays[0].data_ptr(), arrays[1].data_ptr(),
                           arrays[2].data_ptr(), arrays[3].data_ptr() if with_max else None,
                           arrays[0].numel(), step_array, len(steps),
                           aux.data_ptr() if aux.numel() else None, aux.numel())
        check(lib.ckpt_optimizer_set_state_with(self.handle, ctypes.byref(state)))

    def aux_offsets(self):
        """Where each piece's aux state begins in the aux slab, then its size (ABI 16)."""
        n = len(self.table.params) if self.shards is None else self.shards.npieces
        out = (ctypes.c_uint64 * (n + 1))()
        check(lib.ckpt_optimizer_aux_offsets(self.handle, out, n + 1))
        return list(out)

    def aux(self):
        """The aux slab (state shaped unlike its parameter), this rank's, flat FP32."""
        out = torch.empty(self.aux_offsets()[-1], dtype=torch.float32)
        check(lib.ckpt_optimizer_read_state(self.handle, _lib.AUX, out.data_ptr(), out.numel()))
        return out

    def set_hyper(self, index, hyper):
        """A group's hyper-parameters its rule keeps by name (`hyper`: name -> number, or None
        to unset an optional one)."""
        for name, value in hyper.items():
            v = None if value is None else ctypes.byref(ctypes.c_double(float(value)))
            check(lib.ckpt_optimizer_set_hyper(self.handle, index, name.encode(), v))

    def get_hyper(self, index, name):
        """A group's hyper-parameter by name: a float, or None for an optional one unset."""
        value, present = ctypes.c_double(), ctypes.c_int()
        check(lib.ckpt_optimizer_get_hyper(self.handle, index, name.encode(),
                                           ctypes.byref(value), ctypes.byref(present)))
        return value.value if present.value else None

    def write_weights(self, ptrs, device, stream):
        """The masters rounded into each parameter's buffer (`ptrs`, one per parameter, on
        `device`, ordered on `stream` for the CUDA engine)."""
        check(lib.ckpt_optimizer_write_piece_weights(self.handle, ptrs, len(self.table.params),
                                                     int(device.type == "cuda"), stream))

    def publish_shards(self):
        """Sharded: the masters rounded, this rank's pieces, into every rank's parameters
        (collective)."""
        local = torch.empty(self.count, dtype=self.table.dtype)
        check(lib.ckpt_optimizer_write_weights(self.handle, local.data_ptr(), 0, None))
        self.shards.publish(local)
