"""ZeRO-1 sharding of a staged optimizer over a torch.distributed process group, modelled on
torch.distributed.optim.ZeroRedundancyOptimizer: each rank owns the pieces of the flat
parameter order that Megatron's buckets give it (ckpt_rank_pieces), keeps and steps only their
state, and the ranks move gradients, weights and state between them by all-reduce.

Collectives run in the same order on every rank: every method that all-reduces is called by
every rank of the group at the same point of the same call (step, load, state read).
torch.distributed is imported where it is used: an optimizer without a process group never
needs it.
"""
import ctypes

import torch

from .. import _lib
from .._lib import CkptError, Code, check, lib
from .params import _DTYPES, _stream_of


def _rank_pieces(specs, count, whole, bucket_elems, world, rank):
    """This rank's pieces of the parameters `specs` describes (a ctypes array of ckpt_piece, and
    how many), with each parameter that `whole` flags (or none: whole is None) on one rank."""
    found = ctypes.c_size_t()
    flags = (ctypes.c_uint8 * count)(*[int(w) for w in whole]) if whole is not None else None

    def ask(out, capacity):
        if flags is not None:
            check(lib.ckpt_rank_pieces_keeping_whole(specs, count, flags, bucket_elems, world,
                                                     rank, out, capacity, ctypes.byref(found)))
        else:
            check(lib.ckpt_rank_pieces(specs, count, bucket_elems, world, rank, out, capacity,
                                       ctypes.byref(found)))
    ask(None, 0)
    pieces = (_lib.Piece * max(1, found.value))()
    ask(pieces, found.value)
    return pieces, found.value


class _Sharding:
    """One optimizer's data-parallel layout and collectives: the pieces this rank owns, as
    (offset in the flat order, offset in this rank's slabs, count), and private buffers (the
    averaged gradients, this rank's pieces of them and of the weights, the weights as the ranks
    exchange them, and the buffers it all-reduces, kept: see reduced()). Made once by the
    optimizer that owns it, from its parameter table, which no longer grows (add_param_group is
    refused with a process group); shared by wrappers that copy the optimizer's __dict__. Not
    thread-safe: its buffers serve one call at a time, on every rank at once."""

    def __init__(self, group, table, specs, whole, bucket_elems, device, reduce_grads):
        import torch.distributed as dist
        self.group = group
        self.table = table
        self.device = device
        self.reduce_grads = reduce_grads
        self.pieces, self.npieces = _rank_pieces(
            specs, len(table.params), whole, bucket_elems, dist.get_world_size(group),
            dist.get_rank(group))
        self.owned = []
        at = 0
        for i in range(self.npieces):
            q = self.pieces[i]
            self.owned.append((table.slices[q.param][0] + q.begin, at, q.count))
            at += q.count
        self.local = at  # The elements this rank owns.
        total, dtype, grad_dtype = table.total, table.dtype, table.grad_dtype
        self.grads = torch.zeros(total, dtype=grad_dtype, device=device)
        self.local_grads = torch.empty(at, dtype=grad_dtype, device=device)
        self.local_params = torch.empty(at, dtype=dtype, device=device)
        self.flat = torch.empty(total, dtype=dtype, device=device)
        self.scratch = {}  # Buffers all-reduced: made once and reused (see reduced()).

    @property
    def rank(self):
        import torch.distributed as dist
        return dist.get_rank(self.group)

    @property
    def world(self):
        import torch.distributed as dist
        return dist.get_world_size(self.group)

    def local_of(self, full, dtype=torch.float32):
        """This rank's elements of a full flat CPU tensor, in slab order."""
        local = torch.empty(self.local, dtype=dtype)
        for flat_at, local_at, n in self.owned:
            local[local_at:local_at + n].copy_(full[flat_at:flat_at + n])
        return local

    def parts(self, offset, count):
        """This rank's pieces of the flat range [offset, offset + count): (offset in its slabs,
        offset in the range, count) of each non-empty one."""
        out = []
        for flat_at, local_at, n in self.owned:
            lo, hi = max(flat_at, offset), min(flat_at + n, offset + count)
            if lo < hi:
                out.append((local_at + lo - flat_at, lo - offset, hi - lo))
        return out

    def agree(self, stepped, failed=False):
        """The parameters any rank has a gradient for (the ranks must step the same ones; a
        rank without one contributes zeros to the average), and whether any rank `failed` (one
        collective)."""
        import torch.distributed as dist
        flags = self.reduced("stepped", len(stepped) + 1, torch.int32)
        flags.copy_(torch.tensor([*stepped, failed], dtype=torch.int32))
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        agreed = [bool(x) for x in flags.tolist()]
        return agreed[:-1], agreed[-1]

    def any_rank(self, flag):
        """Whether `flag` holds on any rank (collective)."""
        import torch.distributed as dist
        word = self.reduced("any", 1, torch.int32)
        word.fill_(int(bool(flag)))
        dist.all_reduce(word, op=dist.ReduceOp.MAX, group=self.group)
        return bool(word.item())

    def step(self, prepare, stepped, coef, new_state):
        """One data-parallel step: the gradients averaged, this rank's pieces stepped (with the
        clipping `coef`), the updated pieces exchanged into every rank's parameters. `prepare()`
        hands ckpt the hyper-parameters and edited parameters and returns (handle, gradient
        scale, indices to negate); `new_state()` drops what described the state before. What
        may fail on one rank alone runs before the ranks' first collective, and that collective
        carries the failure: every rank raises, none waits for the others."""
        failure = None
        try:
            handle, scale, flip = prepare()
        except Exception as e:  # noqa: BLE001 (re-raised on this rank below)
            failure = e
        stepped, failed = self.agree(stepped, failure is not None)
        if failed:
            if failure is not None:
                raise failure
            raise CkptError(Code.ABORTED, "step(): another rank of the process group failed "
                                          "before stepping; no rank stepped")
        if not any(stepped):
            return
        new_state()
        n, skipped = len(stepped), ctypes.c_int(0)
        self.reduce_gradients(flip)
        grads, params = self.step_pointers()
        try:
            check(lib.ckpt_optimizer_step_masked(
                handle, grads, params, len(grads), (ctypes.c_uint8 * n)(*stepped), n,
                _DTYPES[self.local_grads.dtype], scale * coef, 0, _stream_of(self.device),
                ctypes.byref(skipped)))
        except CkptError as e:
            failure = e
        # Before the exchange: a rank whose step failed would otherwise leave the others
        # waiting in it.
        if self.any_rank(failure is not None):
            if failure is not None:
                raise failure
            raise CkptError(Code.ABORTED,
                            "step(): another rank of the process group failed in its step; "
                            "this rank stepped its own pieces, which the others did not "
                            "receive: load the last checkpoint")
        self.exchange(self.local_params, only=stepped)

    def reduce_gradients(self, flip):
        """The parameters' gradients (zeros for those without one) averaged over the ranks in
        FP32 (unless reduce_grads is off: DDP averaged them), negated for the indices `flip`
        (maximize in their group only), and this rank's pieces of them into local_grads (gloo
        cannot all-reduce BF16, and a sum in F16 overflows where the mean would not)."""
        import torch.distributed as dist
        for p, (o, count) in zip(self.table.params, self.table.slices):
            if p.grad is None:
                self.grads[o:o + count].zero_()
            else:
                self.grads[o:o + count].copy_(p.grad.reshape(-1))
        if self.reduce_grads:
            dist.all_reduce(self.grads, group=self.group)
            self.grads.div_(dist.get_world_size(self.group))
        for i in flip:
            o, count = self.table.slices[i]
            self.grads[o:o + count].neg_()
        for flat_at, local_at, n in self.owned:
            self.local_grads[local_at:local_at + n].copy_(self.grads[flat_at:flat_at + n])

    def step_pointers(self):
        """Where ckpt's step reads this rank's pieces of the gradients and writes its pieces of
        the weights: (gradient pointers, weight pointers), one per piece, as ctypes arrays."""
        gsize, psize = self.local_grads.element_size(), self.local_params.element_size()
        gbase, pbase = self.local_grads.data_ptr(), self.local_params.data_ptr()
        k = len(self.owned)
        return ((ctypes.c_void_p * k)(*[gbase + at * gsize for _, at, _ in self.owned]),
                (ctypes.c_void_p * k)(*[pbase + at * psize for _, at, _ in self.owned]))

    def exchange(self, local, only=None):
        """Every rank's updated pieces (`local`, in slab order) into every rank's parameters
        (those `only` flags, or all): each rank places its own in a zeroed full buffer and the
        ranks sum them bit pattern for bit pattern (each element has exactly one owner), which
        is exact in any dtype."""
        import torch.distributed as dist
        nbytes = self.flat.numel() * self.flat.element_size()
        # Summed as int32 words: each bit comes from one rank at most, so the sum is the OR of
        # the ranks' bits, with no carry (2-byte elements of two owners may share a word).
        # Kept (reused) after the call: a tensor whose last reference gloo's worker thread drops
        # crashes a process that exits right after (pytorch/pytorch#179291); see reduced().
        words = self.reduced("exchange", (nbytes + 3) // 4, torch.int32)
        words.zero_()
        full = words.view(torch.uint8)[:nbytes].view(self.flat.dtype)
        for flat_at, local_at, n in self.owned:
            full[flat_at:flat_at + n].copy_(local[local_at:local_at + n])
        dist.all_reduce(words, group=self.group)
        self.flat.copy_(full)
        with torch.no_grad():
            for i, (p, (o, n)) in enumerate(zip(self.table.params, self.table.slices)):
                if only is None or only[i]:
                    p.detach().copy_(self.flat[o:o + n].view(p.shape))
        self.table.note_versions()

    def publish(self, local):
        """After a load: this rank's pieces of the weights (a CPU tensor in slab order) into
        every rank's parameters (collective)."""
        self.exchange(local.to(self.device))
        self.local_params.copy_(local)

    def whole(self, local):
        """One state tensor over every parameter, as a new CPU tensor, from each rank's pieces
        (`local`, this rank's, in slab order; collective)."""
        import torch.distributed as dist
        # On the parameters' device: NCCL reduces device tensors only.
        full = self.reduced("state", self.table.total, torch.float32)
        full.zero_()
        for flat_at, local_at, n in self.owned:
            full[flat_at:flat_at + n].copy_(local[local_at:local_at + n])
        dist.all_reduce(self.scratch["state_words"], group=self.group)
        return full.cpu() if full.device.type != "cpu" else full.clone()

    def whole_range(self, offset, count, read):
        """The flat range [offset, offset + count) of one state tensor, as a new CPU tensor:
        `read(slab offset, count)` returns this rank's elements there (a CPU tensor); the ranks'
        pieces are summed as int32 words in a buffer of the largest parameter's size (collective:
        each element comes from the one rank that owns it)."""
        import torch.distributed as dist
        full = self.reduced("param", max(k for _, k in self.table.slices), torch.float32)
        full.zero_()
        for local_at, at, k in self.parts(offset, count):
            full[at:at + k].copy_(read(local_at, k))
        dist.all_reduce(self.scratch["param_words"], group=self.group)
        return full[:count].to("cpu", copy=True)

    def reduced(self, name, count, dtype):
        """A buffer this optimizer all-reduces, made once and kept with the exact tensor object
        passed to the collective: torch's gloo worker thread may drop its reference to a reduced
        tensor after the call returned, and if that is the last one while the interpreter exits,
        freeing it takes the GIL from a dying thread and aborts the process
        (pytorch/pytorch#179291). Kept here, the last reference is never gloo's."""
        if name not in self.scratch or self.scratch[name].numel() != count:
            buf = torch.zeros(count, dtype=dtype, device=self.device)
            if name in self.scratch:  # Resized: the old one stays ours.
                self.scratch.setdefault("retired", []).append(self.scratch[name])
            self.scratch[name] = buf
            if name in ("state", "param"):
                self.scratch[name + "_words"] = buf.view(torch.int32)
        return self.scratch[name]
