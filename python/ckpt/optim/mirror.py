"""The CPU engine's host mirror of CUDA parameters (engine="cpu", or a GPU the algorithm cannot
run on): pinned host copies of their gradients and weights, where ckpt reads and writes them;
and the parameters' weights gathered on the host for ckpt_optimizer_create and add_params.
"""
import collections

import torch

from .params import _seen_of


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


class _HostMirror:
    """engine="cpu" with CUDA parameters: each such parameter's gradient and weight where the
    CPU engine reads and writes them, in pinned host memory (one buffer of each, made at the
    first step and again when parameters are added). A plain step copies the gradients out on
    the current stream. An overlapped step copies each one out as its hook runs, on a stream
    of the mirror's own that waits for the stream the gradient was made on, and hands it to
    ckpt once the copy has landed (an event query at the next hooks: backward never waits for
    the copies). After the step the weights ckpt wrote are copied back in place on the current
    stream (overlap="forward": on the mirror's stream, each module's next forward waiting for
    its own); ckpt writes the buffer again only after those copies have run. One per optimizer,
    which owns it (kept where wrappers copying the optimizer's __dict__ see it). Not
    thread-safe: backward's hooks use it under the overlapped step's lock, the optimizer's calls
    between backwards."""

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
