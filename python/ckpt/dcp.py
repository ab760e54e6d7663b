"""ckpt as torch.distributed.checkpoint's storage layer: `StorageWriter` and `StorageReader`
over a ckpt store, so that any DCP user (FSDP2, torchtitan, accelerate's FSDP) gets ckpt's
atomic commit, per-chunk checksums, io_uring O_DIRECT, `ckpt-tool inspect/verify/diff` and
loading at another world size.

    import torch.distributed.checkpoint as dcp
    import ckpt.dcp
    dcp.save(state, storage_writer=ckpt.dcp.StorageWriter("ckpts", step=100))
    dcp.load(state, storage_reader=ckpt.dcp.StorageReader("ckpts"))          # LATEST
    # or, torchtitan's naming: checkpoint_id="ckpts/step-100" with StorageWriter() / Reader()

A dcp.save is one ckpt save transaction: the step is committed wholly (LATEST names it) or not
at all; a save killed at any point publishes nothing, and the next writer's recovery removes
what it left. DCP's phases carry the store's save protocol (libckpt/store/transaction.cc and
commit.cc), whose collectives ride on DCP's own exchanges:

1. prepare_local_plan, every rank: marks its plan with whether it is DCP's coordinator.
2. prepare_global_plan, the coordinator: opens the primary store handle (its recovery removes
   what an earlier killed save left), begins the step as ckpt rank 0 (the staging directory),
   and hands every rank, in its plan, the begin broadcast's message, its ckpt rank (DCP's
   coordinator is ckpt rank 0) and the world size and step.
3. write_data, every rank: the others open a handle of their own and join the transaction (the
   begin broadcast is answered from the plan). Each rank writes its items: a tensor chunk that
   is one range of its tensor's flat index as a piece of the tensor named by its fully
   qualified name (so the step holds whole tensors, whichever ranks wrote them); any other
   chunk as a tensor of its own; byte items as blobs. A rank other than the coordinator then
   commits its half: its data file and its part are synced, and the vote its commit hands to
   the all-gather ("ok <digest of its part>" or "no <error>") is kept and returned with its
   write results; the all-gather then reports failure, so that rank publishes nothing and ends.
   Errors are returned as results, not raised: DCP would then skip finish, and the
   coordinator's open transaction would hold the store.
4. finish, the coordinator: when any rank reported an error it aborts (the staging directory
   goes) and raises it, naming the rank. Otherwise it stores DCP's Metadata (pickled, as DCP's
   own writer does) as blob "dcp.metadata" and commits: the votes of step 3 answer the
   all-gather, so rank 0 reads every rank's part, checks it against its vote's digest, writes
   MANIFEST, renames the step into place and publishes LATEST (commit.cc steps 5-8).

One save owns a writer from its set-up (dcp.async_save's call included) to its commit: a second
save through it, a reset to another checkpoint_id or close() meanwhile is refused by name, and
the root and step a save was set up for cannot be redirected (ckpt/_dcp_writer.py, O1-O6).

Loading reads DCP's Metadata from the step, then each read item's box of its tensor through
ckpt's range reads (every chunk checksummed): a box of the global tensor whatever the world size
that wrote it. Like torch.load and DCP's own reader, loading unpickles the metadata and byte
items: load only checkpoints you trust.
"""
import ctypes
import io
import os
import pickle

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType
from torch.distributed.checkpoint.storage import StorageReader as _DcpReader
from torch.futures import Future

from . import _dcp_common as common
from . import _lib
from ._dcp_common import latest_step, split_checkpoint_id
from ._dcp_writer import StorageWriter
from ._lib import CkptError, Code, lib
from ._native import Native

__all__ = ["StorageWriter", "StorageReader", "latest_step", "split_checkpoint_id"]

METADATA_BLOB = common.METADATA_BLOB


class _StepReader:
    """A committed step's ckpt_reader."""

    def __init__(self, store, step):
        handle = ctypes.c_void_p()
        common.check_code(lib.ckpt_reader_open(store.handle, step, ctypes.byref(handle)),
                          f"opening step {step}")
        self.native = Native(handle, lib.ckpt_reader_close, "reader", parents=(store,))
        self.step = step

    def blob(self, name, rank=0):
        size = ctypes.c_size_t()
        raw = _lib.encode_text(name, "blob")
        common.check_code(lib.ckpt_reader_blob(self.native.handle, raw, rank, None, 0,
                                               ctypes.byref(size)),
                          f"step {self.step}: blob {name!r}")
        buf = ctypes.create_string_buffer(max(1, size.value))
        common.check_code(lib.ckpt_reader_blob(self.native.handle, raw, rank, buf, size.value,
                                               ctypes.byref(size)),
                          f"step {self.step}: blob {name!r}")
        return buf.raw[:size.value]

    def tensor(self, name):
        """(dtype, shape) of tensor `name`, of any rank."""
        dtype, ndim, capacity = ctypes.c_int(), ctypes.c_size_t(), 16
        raw = _lib.encode_text(name, "tensor")
        while True:
            dims = (ctypes.c_uint64 * capacity)()
            common.check_code(lib.ckpt_reader_tensor(self.native.handle, raw, ctypes.byref(dtype),
                                                     dims, capacity, ctypes.byref(ndim)),
                              f"step {self.step}: tensor {name!r}")
            if ndim.value <= capacity:
                return common.TORCH_DTYPES[dtype.value], [int(d) for d in dims[:ndim.value]]
            capacity = ndim.value

    def read_many(self, reads):
        """Every (tensor name, begin, CPU tensor) of `reads`: elements [begin, begin + numel)
        into the tensor, all in one pipeline of ckpt's reader."""
        n = len(reads)
        if n == 0:
            return
        names = (ctypes.c_char_p * n)(*[_lib.encode_text(r[0], "tensor") for r in reads])
        begins = (ctypes.c_uint64 * n)(*[r[1] for r in reads])
        counts = (ctypes.c_uint64 * n)(*[r[2].numel() for r in reads])
        outs = (ctypes.c_void_p * n)(*[r[2].data_ptr() for r in reads])
        sizes = (ctypes.c_size_t * n)(*[r[2].numel() * r[2].element_size() for r in reads])
        common.check_code(lib.ckpt_reader_read_many(self.native.handle, n, names, begins,
                                                    counts, outs, sizes),
                          f"step {self.step}: reading {n} ranges")


class _BoxReads:
    """The boxes of one read_data, gathered into batches of range reads (one ckpt pipeline per
    batch), then copied into their targets. Memory beyond the targets (boxes whose target is
    not a contiguous CPU tensor of the stored dtype, and the spans of boxes of many short runs)
    is bounded per batch; for targets on a GPU it is one pinned arena, reused batch after batch
    (the copies to the GPU then run at the bus's speed)."""

    def __init__(self, reader, batch_bytes=256 << 20):
        self.reader, self.batch_bytes = reader, batch_bytes
        self.reads, self.copies, self.done = [], [], []
        self.spare = 0
        self.arena, self.used = None, 0

    def _temp(self, numel, dtype, gpu):
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if not gpu:
            return torch.empty(numel, dtype=dtype)
        if nbytes > self.batch_bytes:
            return common.pinned(nbytes)[:nbytes].view(dtype)
        if self.used + nbytes > self.batch_bytes:
            self.flush()
        if self.arena is None:
            self.arena = common.pinned(self.batch_bytes)
        at = self.used
        self.used += (nbytes + 63) // 64 * 64
        return self.arena[at:at + nbytes].view(dtype)

    def add(self, name, shape, dtype, offsets, sizes, target, done):
        """Box `offsets`/`sizes` of tensor `name` (of `shape`) into `target`; then done()."""
        direct = (target.device.type == "cpu" and target.dtype == dtype
                  and target.is_contiguous() and list(target.shape) == list(sizes))
        if not direct and list(target.shape) != list(sizes):
            raise CkptError(Code.INVALID_ARGUMENT,
                            f"tensor {name!r}: the target holds {list(target.shape)}, the "
                            f"step {list(sizes)}")
        gpu = target.device.type == "cuda"
        runs = common.runs(shape, offsets, sizes)
        span = (runs[-1][0] + runs[-1][1] - runs[0][0]) if runs else 0
        element = torch.empty((), dtype=dtype).element_size()
        if len(runs) > 64 and (span - common.numel(sizes)) * element <= common.SPAN_SLACK_BYTES:
            # Many short runs close together: one read of their span, then a strided copy.
            whole = self._temp(span, dtype, gpu)
            self.reads.append((name, runs[0][0], whole))
            self.copies.append((target, whole.as_strided(sizes, common.strides(shape))))
            self.spare += span * element
        else:
            out = target if direct else self._temp(common.numel(sizes), dtype, gpu).view(sizes)
            flat = out.view(-1)
            at = 0
            for begin, count in runs:
                self.reads.append((name, begin, flat[at:at + count]))
                at += count
            if not direct:
                self.copies.append((target, out))
                self.spare += out.numel() * element
        self.done.append(done)
        if self.spare >= self.batch_bytes:
            self.flush()

    def flush(self):
        self.reader.read_many(self.reads)
        devices = set()
        for target, box in self.copies:
            if target.device.type == "cuda":
                devices.add(target.device)
            target.copy_(box, non_blocking=box.is_pinned())
        for device in devices:
            torch.cuda.synchronize(device)  # The arena is reused; done() sees the data in place.
        for then in self.done:
            then()
        self.reads, self.copies, self.done = [], [], []
        self.spare = self.used = 0


class StorageReader(_DcpReader):
    """DCP storage reader over ckpt store `root`: reads step `step` (None: the step LATEST
    names), or the step a checkpoint_id names ("<root>/step-<N>")."""

    def __init__(self, root=None, step=None):
        super().__init__()
        self.root, self.step = root, step
        self.checkpoint_id = None
        self._store = self._reader = None
        self._storage_data = None

    def close(self):
        """Lets go of the step's files."""
        reader, store = self._reader, self._store
        self._reader = self._store = None
        if reader is not None:
            reader.native.close()
        if store is not None:
            store.close()

    def reset(self, checkpoint_id=None):
        self.close()
        if checkpoint_id is not None:
            self.checkpoint_id = checkpoint_id
            self.root, self.step = split_checkpoint_id(checkpoint_id)

    validate_checkpoint_id = classmethod(
        lambda cls, checkpoint_id: common.names_a_step(checkpoint_id))

    def _open(self):
        if self._reader is not None:
            return self._reader
        if self.root is None:
            raise ValueError("ckpt.dcp.StorageReader needs a root: pass it, or a checkpoint_id "
                             "naming <root>/step-<N>")
        if not os.path.isdir(self.root):
            raise CkptError(Code.NOT_FOUND, f"{self.root}: no ckpt store there")
        self._store = common.open_store(self.root, False, read_only=True)
        step = self.step if self.step is not None else common.latest(self._store)
        if step is None:
            raise CkptError(Code.NOT_FOUND, f"{self.root}: no committed step (no LATEST)")
        self._reader = _StepReader(self._store, step)
        return self._reader

    def read_metadata(self, *args, **kwargs):
        if kwargs.get("rank") is not None:
            raise CkptError(Code.NOT_FOUND,
                            "a ckpt step holds one metadata for the whole job, not per rank")
        reader = self._open()
        metadata = pickle.loads(reader.blob(common.METADATA_BLOB))
        if not isinstance(metadata, Metadata):
            raise CkptError(Code.DATA_LOSS,
                            f"{self.root} step {reader.step}: blob {METADATA_BLOB} is not "
                            f"DCP metadata")
        return metadata

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs):
        self._storage_data = metadata.storage_data

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def read_data(self, plan, planner):
        reader = self._open()
        shapes = {}
        boxes = _BoxReads(reader)
        for item in plan.items:
            where = self._storage_data.get(item.storage_index)
            if where is None:
                raise CkptError(Code.NOT_FOUND, f"step {reader.step}: nothing stored for "
                                   f"{item.storage_index.fqn!r}")
            kind, name, rank = where
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(reader.blob(name, rank)))
                continue
            if name not in shapes:
                shapes[name] = reader.tensor(name)
            dtype, shape = shapes[name]
            offsets = list(item.storage_offsets)
            if kind == "piece":
                offsets = [o + c for o, c in zip(offsets, item.storage_index.offset)]
            target = planner.resolve_tensor(item).detach()
            boxes.add(name, shape, dtype, offsets, list(item.lengths), target,
                      lambda item=item, target=target: planner.commit_tensor(item, target))
        boxes.flush()
        future = Future()
        future.set_result(None)
        return future
