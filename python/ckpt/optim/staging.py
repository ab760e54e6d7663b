"""Where ckpt's native calls read each gradient and write each parameter: in place where it
can (a contiguous tensor of the step's dtype on the engine's device), else through a converted
or contiguous copy on the engine's device, or (the CPU engine's CUDA parameters) the host
mirror; and, after the call, the copies written back into the parameters.
"""
import contextlib
import ctypes

import torch

from .._lib import CkptError, check, lib
from .params import _DTYPES, _stream_of


class _StepBuffers:
    """The pointers a plain step hands ckpt (None for a parameter without a gradient), and what
    must stay alive until the call returns: gradients converted for ckpt (`keep`), contiguous
    copies of parameters ckpt writes (`staged`, copied back by write_back), and the indices
    stepped through the host mirror (`mirrored`). Made and used by one step on the optimizer's
    thread; not thread-safe."""

    def __init__(self, table, grad_of, device, flip, mirror):
        self.keep = []  # Gradients converted for ckpt, alive until the call returns.
        self.staged = []  # (parameter, contiguous copy) of non-contiguous parameters.
        self.grads, self.params = [], []
        self.mirrored = []  # CUDA parameters the CPU engine steps through the host mirror.
        want = table.grad_dtype
        if mirror is not None:
            mirror.fit(table.params, want)
            mirror.flush()
        for i, (p, g, ptr, home) in enumerate(zip(table.params, grad_of, table.seen,
                                                   table.devices)):
            if g is None:
                self.grads.append(None)
                self.params.append(None)
            elif mirror is not None and home.type == "cuda" and p.is_contiguous():
                self._through_mirror(i, g, want, i in flip, mirror)
            else:
                self._on_engine(p, g, ptr[1], home, want, device, i in flip)

    def _through_mirror(self, i, g, want, negate, mirror):
        """Converted on the GPU if need be, then out to the pinned host copy."""
        if g.dtype is not want or not g.is_contiguous():
            g = g.to(dtype=want).contiguous()
            self.keep.append(g)
        if negate:
            g = g.neg()
            self.keep.append(g)
        mirror.grads[i].copy_(g.view(-1), non_blocking=True)
        self.grads.append(mirror.grad_ptr[i])
        self.params.append(mirror.weight_ptr[i])
        self.mirrored.append(i)

    def _on_engine(self, p, g, written_ptr, home, want, device, negate):
        # torch keeps a gradient on its parameter's device and of its dtype; it is converted
        # when the step takes FP32 gradients (several parameter dtypes) or is strided.
        if g.dtype is not want or not g.is_contiguous() or home != device:
            g = g.to(device=device, dtype=want).contiguous()
            self.keep.append(g)
        if negate:  # maximize in this parameter's group only: a negated copy.
            g = g.neg()
            self.keep.append(g)
        self.grads.append(g.data_ptr())
        if home != device or not p.is_contiguous():
            # ckpt writes elements in row-major order, on its engine's device: through a
            # contiguous copy there.
            self.staged.append((p, p.detach().to(device).contiguous()))
            self.params.append(self.staged[-1][1].data_ptr())
        else:
            self.params.append(written_ptr)

    def arrays(self):
        """(gradient pointers, parameter pointers) as ctypes arrays."""
        n = len(self.grads)
        return (ctypes.c_void_p * n)(*self.grads), (ctypes.c_void_p * n)(*self.params)

    def write_back(self):
        """The staged copies ckpt wrote, into their parameters; whether there were any."""
        for p, copy in self.staged:
            p.detach().copy_(copy)
        return bool(self.staged)


def _step_in_place(handle, table, grad_of, stepped, device, scale, flip, mirror, run, whole):
    """One process's plain step: every gradient read and every parameter written in place, in
    one native call (through _StepBuffers' copies where ckpt cannot take them as they are).
    `run` is the optimizer's _OverlapRun, whose gate (overlap="forward") opens after it."""
    stream, n = _stream_of(device), len(table.params)
    mask = (ctypes.c_uint8 * n)(*stepped)
    skipped, dtype = ctypes.c_int(0), _DTYPES[table.grad_dtype]
    buffers = _StepBuffers(table, grad_of, device, flip, mirror)
    grads, params = buffers.arrays()
    if run.gate and stream is not None and not buffers.keep and not buffers.staged:
        # overlap="forward" with nothing speculated (clipping fired): the plain step, gated,
        # so that the next forward still hides it layer by layer.
        gated = ctypes.c_int(0)
        with _settled_on_failure(device):
            check(lib.ckpt_optimizer_step_gated(handle, grads, params, n, mask, n, dtype, scale,
                                                0, stream, ctypes.byref(skipped),
                                                ctypes.byref(gated)))
        if gated.value:
            run.open_gate(grad_of, table, whole)
        return
    if buffers.mirrored:
        torch.cuda.current_stream(mirror.device).synchronize()  # The gradients landed.
        mirror.wait_written()  # The last step's weights have left the buffer.
    with _settled_on_failure(device):
        check(lib.ckpt_optimizer_step_masked(handle, grads, params, n, mask, n, dtype, scale, 0,
                                             stream, ctypes.byref(skipped)))
    buffers.keep.clear()  # The converted gradients: ckpt has read them.
    if buffers.mirrored and not skipped.value:
        run.gate_mirror(mirror.copy_in(table.params, buffers.mirrored, table.seen, gated=run.gate),
                        mirror.device, table, whole)
    if buffers.write_back():
        table.note_versions()


def _weight_targets(table, device):
    """Where ckpt writes the weights after a load: each parameter's own storage, or (another
    device, non-contiguous) a contiguous copy on the engine's device. Returns (pointers as a
    ctypes array, [(parameter, copy)] to copy back)."""
    staged = [(p, p.detach().to(device).contiguous())
              for p, home in zip(table.params, table.devices)
              if home != device or not p.is_contiguous()]
    copies = {id(p): c for p, c in staged}
    n = len(table.params)
    ptrs = (ctypes.c_void_p * n)(*[copies[id(p)].data_ptr() if id(p) in copies
                                   else p.data_ptr() for p in table.params])
    return ptrs, staged


@contextlib.contextmanager
def _settled_on_failure(device):
    """A native step that fails on the CUDA engine may have queued work that still reads the
    gradients: the device is waited for before the error reaches the caller, who may then free
    them (the converted copies go at once) or zero them in place."""
    try:
        yield
    except CkptError:
        if device.type == "cuda":
            try:
                torch.cuda.synchronize(device)
            except RuntimeError:
                pass  # A device error: nothing it queued runs any more.
        raise
