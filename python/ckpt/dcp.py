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

Loading reads DCP's Metadata from the step, then each read item's box of its tensor through
ckpt's range reads (every chunk checksummed): a box of the global tensor whatever the world size
that wrote it. Like torch.load and DCP's own reader, loading unpickles the metadata and byte
items: load only checkpoints you trust.
"""
import ctypes
import dataclasses
import io
import os
import pickle
import re
import threading
import weakref

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader as _DcpReader
from torch.distributed.checkpoint.storage import StorageWriter as _DcpWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from . import _lib
from ._lib import CkptError, check, lib
from ._native import Native
from .checkpointer import hand_back

__all__ = ["StorageWriter", "StorageReader", "latest_step", "split_checkpoint_id"]

METADATA_BLOB = "dcp.metadata"
# The write result that carries a rank's vote (step 3); never part of the stored metadata.
_VOTE_INDEX = MetadataIndex("ckpt.dcp.vote")
_STEP_DIR = re.compile(r"step-0*(\d+)")
_DTYPES = {torch.float32: _lib.F32, torch.bfloat16: _lib.BF16, torch.float16: _lib.F16,
           torch.float64: _lib.F64, torch.int64: _lib.I64, torch.int32: _lib.I32,
           torch.int16: _lib.I16, torch.int8: _lib.I8, torch.uint8: _lib.U8,
           torch.bool: _lib.BOOL}
_TORCH_DTYPES = {code: dtype for dtype, code in _DTYPES.items()}
# Bytes a read of a box may span beyond the box itself, to make one read of many short runs.
_SPAN_SLACK_BYTES = 64 << 20


def split_checkpoint_id(checkpoint_id):
    """(root, step) of a DCP checkpoint id naming a step directory ("ckpts/step-100", or ckpt's
    own "ckpts/step-00000100"); (checkpoint_id, None) for any other path (a store's root)."""
    path = os.path.normpath(os.fspath(checkpoint_id))
    head, tail = os.path.split(path)
    match = _STEP_DIR.fullmatch(tail)
    if match is None:
        return path, None
    return head or ".", int(match.group(1))


def _names_a_step(checkpoint_id):
    """DCP's validate_checkpoint_id, for the writer and the reader: an id naming a step."""
    try:
        return split_checkpoint_id(checkpoint_id)[1] is not None
    except TypeError:
        return False


def latest_step(root):
    """The step LATEST of store `root` names (what a resume loads), or None when nothing is
    committed there (or there is no store)."""
    if not os.path.isdir(root):
        return None
    store = _open_store(root, False, read_only=True)
    try:
        return _latest(store)
    finally:
        store.close()


def _latest(store):
    has, step = ctypes.c_int(), ctypes.c_uint64()
    check(lib.ckpt_store_latest(store.handle, ctypes.byref(has), ctypes.byref(step)))
    return step.value if has.value else None


def _store_name(fqn):
    # A fully qualified name as a ckpt tensor or blob name: ckpt refuses '/', '\\', "..",
    # control characters; '@' is escaped too, as it separates a chunk's offsets.
    out = []
    for i, c in enumerate(fqn):
        if c in "%/\\@" or ord(c) < 0x20 or ord(c) == 0x7F or (c == "." and fqn[i - 1:i] == "."):
            out.append("%%%02X" % ord(c))
        else:
            out.append(c)
    return "".join(out)


def _strides(shape):
    strides, at = [], 1
    for n in reversed(shape):
        strides.append(at)
        at *= n
    return list(reversed(strides))


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def _flat_range(shape, offsets, sizes):
    """(begin, count) when box `offsets`/`sizes` of a tensor of `shape` is one range of its flat
    index (dims before the one cut hold one index each); None otherwise."""
    cut = [d for d in range(len(shape)) if sizes[d] != shape[d]]
    if cut and any(sizes[d] != 1 for d in range(cut[-1])):
        return None
    begin = sum(o * s for o, s in zip(offsets, _strides(shape)))
    return begin, _numel(sizes)


def _runs(shape, offsets, sizes):
    """The box's ranges of the flat index, in the box's row-major order: (begin, count)."""
    d = len(shape)
    while d > 0 and sizes[d - 1] == shape[d - 1]:
        d -= 1
    if d == 0:
        return [(0, _numel(shape))] if _numel(sizes) else []
    strides = _strides(shape)
    run = sizes[d - 1] * strides[d - 1]
    base = sum(o * s for o, s in zip(offsets, strides))
    starts = [base]
    for j in range(d - 1):
        starts = [s + i * strides[j] for s in starts for i in range(sizes[j])]
    return [(s, run) for s in starts] if run else []


def _check_code(code, what):
    if code != _lib.OK:
        message = lib.ckpt_last_error()
        text = message.decode("utf-8", "replace") if message else ""
        raise CkptError(code, f"{what}: {text}")


def _open_store(root, primary, read_only=False, keep_last=0, keep_every=0):
    options = _lib.StoreOptions(ctypes.sizeof(_lib.StoreOptions), 1 if primary else 0,
                                1 if read_only else 0, keep_last, keep_every, 0)
    handle = ctypes.c_void_p()
    check(lib.ckpt_store_open_with(_lib.encode_path(root, "root"), ctypes.byref(options),
                                   ctypes.byref(handle)))
    return Native(handle, lib.ckpt_store_close, "store")


class _Relay:
    """The ckpt coordinator of one rank's part in a DCP save: DCP's own exchanges carry the
    store protocol's, so each all-gather is answered from what DCP delivered (step 2's begin
    message, step 3's votes) and what this rank hands to it is kept (its vote)."""

    def __init__(self, rank, size):
        self.answers = []  # One per expected all-gather: mine -> every rank's bytes, or None.
        self.said = []
        self._callback = _lib.ALL_GATHER(self._all_gather)
        self.table = _lib.Coordinator(None, rank, size, self._callback, _lib.BARRIER())

    def _all_gather(self, _user, data, length, out, lens):
        try:
            mine = ctypes.string_at(data, length) if length else b""
            self.said.append(mine)
            answer = self.answers.pop(0)(mine) if self.answers else None
            return 1 if answer is None else hand_back(answer, out, lens)
        except Exception:  # Reported to ckpt as a failed exchange, never raised through C.
            return 1


class _Save:
    """One rank's side of a ckpt save transaction (ckpt_save_*), with its relay."""

    def __init__(self, store, step, rank, size, begin_message=None):
        self.relay = _Relay(rank, size)
        self.rank, self.size, self.step = rank, size, step
        if rank == 0:
            self.relay.answers.append(lambda mine: [mine] + [b""] * (size - 1))
        else:
            self.relay.answers.append(lambda mine: [begin_message] + [b""] * (size - 1))
        handle = ctypes.c_void_p()
        _check_code(lib.ckpt_save_begin(store.handle, step, ctypes.byref(self.relay.table),
                                        ctypes.byref(handle)), f"begin saving step {step}")
        self.begin_message = self.relay.said[0]
        self.native = Native(handle, lib.ckpt_save_destroy, "save", parents=(store,),
                             keep=(self.relay,))
        self._declared = {}

    def declare(self, name, dtype, shape):
        known = self._declared.get(name)
        if known is not None:
            if known != (dtype, tuple(shape)):
                raise ValueError(f"tensor {name!r} is written as {dtype} {list(shape)} and as "
                                 f"{known[0]} {list(known[1])}")
            return
        dims = (ctypes.c_uint64 * max(1, len(shape)))(*shape)
        _check_code(lib.ckpt_save_declare(self.native.handle, _lib.encode_text(name, "tensor"),
                                          _DTYPES[dtype], dims, len(shape)),
                    f"declaring tensor {name!r}")
        self._declared[name] = (dtype, tuple(shape))

    def write(self, name, begin, tensor):
        count = tensor.numel()
        if count == 0:
            return
        _check_code(lib.ckpt_save_write(self.native.handle, _lib.encode_text(name, "tensor"),
                                        begin, count, tensor.data_ptr(),
                                        count * tensor.element_size()),
                    f"writing elements [{begin}, {begin + count}) of tensor {name!r}")

    def write_blob(self, name, data):
        raw = bytes(data)
        _check_code(lib.ckpt_save_write_blob(self.native.handle, _lib.encode_text(name, "blob"),
                                             raw, len(raw)), f"writing blob {name!r}")

    def vote(self):
        """Rank ≠ 0: syncs this rank's data and part and returns its vote (step 3)."""
        code = lib.ckpt_save_commit(self.native.handle)  # The relay refuses the exchange.
        self.native.close()
        if len(self.relay.said) < 2:
            _check_code(code, f"rank {self.rank}: finishing step {self.step}")
            raise CkptError(13, f"rank {self.rank}: the commit of step {self.step} cast no vote")
        return self.relay.said[1]

    def commit(self, votes):
        """Rank 0: commits with every rank's vote (step 4)."""
        self.relay.answers.append(lambda mine: [mine] + list(votes))
        self.relay.answers.append(lambda mine: [mine] + [b""] * (self.size - 1))
        try:
            _check_code(lib.ckpt_save_commit(self.native.handle), f"committing step {self.step}")
        finally:
            self.native.close()

    def abort(self):
        # No answer to its exchange: rank 0 then removes the staging directory itself.
        self.native.close()


class StorageWriter(_DcpWriter):
    """DCP storage writer over ckpt store `root`: each dcp.save (or dcp.async_save) commits
    step `step` wholly or not at all. `root` and `step` may instead come from the checkpoint_id
    DCP passes ("<root>/step-<N>"). `keep_last`/`keep_every`: the store's retention after each
    commit (0: keep every step)."""

    def __init__(self, root=None, step=None, *, keep_last=0, keep_every=0):
        super().__init__()
        self.root, self.step = root, step
        self.keep_last, self.keep_every = keep_last, keep_every
        self.checkpoint_id = None
        self.is_coordinator = True
        self._store = None
        self._save = None
        self._use_collectives = True
        # A save is in progress from the coordinator's begin (step 2) to its finish (step 4),
        # and on any rank while its writes run (step 3), possibly in dcp.async_save's thread:
        # another save through this writer meanwhile is refused, not allowed to free its handles.
        self._lock = threading.Lock()
        self._writing = 0
        finalizer = weakref.finalize(self, StorageWriter._release, self.__dict__)
        finalizer.atexit = False

    @staticmethod
    def _release(state):
        save, store = state.get("_save"), state.get("_store")
        state["_save"] = state["_store"] = None
        if save is not None:
            save.abort()
        if store is not None:
            store.close()

    def close(self):
        """Abandons a save DCP did not finish (it skips finish when a rank fails before its
        writes: call close() after a failed dcp.save to let go of the store's LOCK at once) and
        lets go of the store. Waits for writes running in another thread."""
        with self._lock:
            if self._writing:
                raise RuntimeError("ckpt.dcp.StorageWriter: a save is writing through this "
                                   "writer in another thread (dcp.async_save); wait for it")
            StorageWriter._release(self.__dict__)

    def _idle(self):
        with self._lock:
            if self._writing or self._save is not None:
                step = self._save.step if self._save is not None else self.step
                raise RuntimeError(
                    f"ckpt.dcp.StorageWriter: the save of step {step} through this writer has "
                    "not finished (an async save still running, or a save that failed before "
                    "its finish: then call close()); use one writer per save in flight")
            StorageWriter._release(self.__dict__)

    def reset(self, checkpoint_id=None):
        self._idle()
        if checkpoint_id is not None:
            self.checkpoint_id = checkpoint_id
            root, step = split_checkpoint_id(checkpoint_id)
            self.root = root
            if step is not None:
                self.step = step

    validate_checkpoint_id = classmethod(lambda cls, checkpoint_id: _names_a_step(checkpoint_id))

    def set_up_storage_writer(self, is_coordinator, *args, **kwargs):
        self._idle()
        self.is_coordinator = is_coordinator
        self._use_collectives = kwargs.get("use_collectives", True)
        dist = torch.distributed
        if not self._use_collectives and dist.is_available() and dist.is_initialized() and \
                dist.get_world_size() > 1:
            # Each rank would commit its own chunks as the whole step.
            raise ValueError("ckpt.dcp.StorageWriter commits one step for the whole job: it "
                             "needs DCP's collectives (use_collectives=True)")

    def prepare_local_plan(self, plan):
        # Step 1.
        return dataclasses.replace(plan, storage_data={"coordinator": self.is_coordinator})

    def prepare_global_plan(self, plans):
        # Step 2.
        if self.root is None or self.step is None:
            raise ValueError("ckpt.dcp.StorageWriter needs a root and a step: pass them, or a "
                             "checkpoint_id naming <root>/step-<N>")
        if not all(getattr(p, "usable", True) for p in plans):
            # DCP would replay a cached plan, carrying an earlier save's begin message.
            raise ValueError("ckpt.dcp.StorageWriter needs every save planned afresh: a "
                             "planner with enable_plan_caching=True replays an earlier save's "
                             "plan")
        size = len(plans)
        me = next((i for i, p in enumerate(plans)
                   if isinstance(p.storage_data, dict) and p.storage_data.get("coordinator")), 0)
        self._idle()
        self._store = _open_store(self.root, True, keep_last=self.keep_last,
                                  keep_every=self.keep_every)
        self._save = _Save(self._store, self.step, 0, size)
        return [dataclasses.replace(plan, storage_data={
                    "begin": self._save.begin_message, "rank": (i - me) % size, "size": size,
                    "step": self.step}) for i, plan in enumerate(plans)]

    def write_data(self, plan, planner):
        # Step 3.
        with self._lock:
            self._writing += 1
        try:
            results = self._write(plan, planner)
        finally:
            with self._lock:
                self._writing -= 1
        future = Future()
        future.set_result(results)
        return future

    def _write(self, plan, planner):
        where = plan.storage_data
        results, error = [], None
        save = self._save
        try:
            if not isinstance(where, dict) or "rank" not in where:
                raise RuntimeError("this DCP plan was not prepared by ckpt.dcp.StorageWriter")
            if self.step is not None and where["step"] != self.step:
                raise RuntimeError(f"this rank's writer saves step {self.step}, the "
                                   f"coordinator's step {where['step']}")
            if where["rank"] != 0:
                StorageWriter._release(self.__dict__)
                self._store = _open_store(self.root, False)
                save = _Save(self._store, where["step"], where["rank"], where["size"],
                             where["begin"])
            _write_items(save, plan.items, planner, results)
        except Exception as e:  # Travels to finish as this rank's result (see step 3).
            error = f"{type(e).__name__}: {e}"
        vote = None
        if save is not None and save.rank != 0:
            try:
                vote = save.vote()
            except Exception as e:
                error = error or f"{type(e).__name__}: {e}"
            StorageWriter._release(self.__dict__)
        rank = where.get("rank") if isinstance(where, dict) else None
        results.append(WriteResult(index=_VOTE_INDEX, size_in_bytes=0,
                                   storage_data=(rank, vote, error)))
        return results

    def finish(self, metadata, results):
        # Step 4.
        votes, errors, storage = {}, [], {}
        for dcp_rank, rank_results in enumerate(results):
            for r in rank_results:
                if r.index == _VOTE_INDEX:
                    rank, vote, error = r.storage_data
                    if error is not None:
                        errors.append(f"DCP rank {dcp_rank}: {error}")
                    elif vote is not None:
                        votes[rank] = vote
                else:
                    storage[r.index] = r.storage_data
        save = self._save
        try:
            if save is None:
                raise CkptError(9, "ckpt.dcp.StorageWriter: finish without a save in progress")
            if errors:
                raise CkptError(10, f"step {save.step} not saved: " + "; ".join(errors))
            if sorted(votes) != list(range(1, save.size)):
                raise CkptError(10, f"step {save.step} not saved: ranks {sorted(votes)} of "
                                    f"1..{save.size - 1} voted")
            metadata.storage_data = storage
            save.write_blob(METADATA_BLOB, pickle.dumps(metadata))
            self._save = None
            save.commit([votes[r] for r in range(1, save.size)])
        finally:
            with self._lock:
                StorageWriter._release(self.__dict__)

    def storage_meta(self):
        return None


def _pinned(nbytes):
    """Host memory the GPU copies into and out of asynchronously, at the bus's speed."""
    return torch.empty(max(1, nbytes), dtype=torch.uint8, pin_memory=True)


def _host_items(items, planner):
    """Yields (item, data) with every tensor on the host. A CUDA tensor is copied into one of
    two pinned buffers on a side stream, and yielded once the next one's copy has begun: the
    copy of each tensor overlaps the write of the one before (each buffer is reused two tensors
    later, after the caller's write of the first returned, which copies its bytes)."""
    slots, stream, pending = [None, None], None, None
    turn = 0
    for item in items:
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO or data.device.type != "cuda":
            if pending is not None:
                pending[2].synchronize()
                yield pending[0], pending[1]
                pending = None
            yield item, data
            continue
        tensor = data.detach()
        nbytes = tensor.numel() * tensor.element_size()
        if slots[turn] is None or slots[turn].numel() < nbytes:
            slots[turn] = _pinned(nbytes)
        host = slots[turn][:nbytes].view(tensor.dtype).view(tensor.shape)
        turn ^= 1
        if stream is None:
            stream = torch.cuda.Stream(tensor.device)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):
            host.copy_(tensor, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
        if pending is not None:
            pending[2].synchronize()
            yield pending[0], pending[1]
        pending = (item, host, copied, tensor)  # The source stays alive until it is copied.
    if pending is not None:
        pending[2].synchronize()
        yield pending[0], pending[1]


def _write_items(save, items, planner, results):
    blobs = 0
    for item, data in _host_items(items, planner):
        if item.type == WriteItemType.BYTE_IO:
            name = f"dcp.bytes.{blobs}"
            blobs += 1
            raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
            save.write_blob(name, raw)
            results.append(WriteResult(index=item.index, size_in_bytes=len(raw),
                                       storage_data=("blob", name, save.rank)))
            continue
        meta = item.tensor_data
        shape = list(meta.size)
        offsets, sizes = list(meta.chunk.offsets), list(meta.chunk.sizes)
        dtype = meta.properties.dtype
        if dtype not in _DTYPES:
            raise TypeError(f"tensor {item.index.fqn!r} is {dtype}, which a ckpt store does not "
                            f"hold (it holds {', '.join(str(d) for d in _DTYPES)})")
        tensor = data.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.to("cpu")
        tensor = tensor.contiguous()
        name = _store_name(item.index.fqn)
        flat = _flat_range(shape, offsets, sizes)
        if flat is not None:
            save.declare(name, dtype, shape)
            save.write(name, flat[0], tensor)
            where = ("piece", name, save.rank)
        else:
            name = f"{name}@{','.join(str(o) for o in offsets)}"
            save.declare(name, dtype, sizes)
            save.write(name, 0, tensor)
            where = ("chunk", name, save.rank)
        results.append(WriteResult(index=item.index,
                                   size_in_bytes=tensor.numel() * tensor.element_size(),
                                   storage_data=where))


class _StepReader:
    """A committed step's ckpt_reader."""

    def __init__(self, store, step):
        handle = ctypes.c_void_p()
        _check_code(lib.ckpt_reader_open(store.handle, step, ctypes.byref(handle)),
                    f"opening step {step}")
        self.native = Native(handle, lib.ckpt_reader_close, "reader", parents=(store,))
        self.step = step

    def blob(self, name, rank=0):
        size = ctypes.c_size_t()
        raw = _lib.encode_text(name, "blob")
        _check_code(lib.ckpt_reader_blob(self.native.handle, raw, rank, None, 0,
                                         ctypes.byref(size)), f"step {self.step}: blob {name!r}")
        buf = ctypes.create_string_buffer(max(1, size.value))
        _check_code(lib.ckpt_reader_blob(self.native.handle, raw, rank, buf, size.value,
                                         ctypes.byref(size)), f"step {self.step}: blob {name!r}")
        return buf.raw[:size.value]

    def tensor(self, name):
        dtype, ndim = ctypes.c_int(), ctypes.c_size_t()
        dims = (ctypes.c_uint64 * 16)()
        _check_code(lib.ckpt_reader_tensor(self.native.handle, _lib.encode_text(name, "tensor"),
                                           ctypes.byref(dtype), dims, 16, ctypes.byref(ndim)),
                    f"step {self.step}: tensor {name!r}")
        if ndim.value > 16:
            raise CkptError(12, f"step {self.step}: tensor {name!r} has {ndim.value} dims")
        return _TORCH_DTYPES[dtype.value], [int(d) for d in dims[:ndim.value]]

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
        _check_code(lib.ckpt_reader_read_many(self.native.handle, n, names, begins, counts, outs,
                                              sizes), f"step {self.step}: reading {n} ranges")


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
            return _pinned(nbytes)[:nbytes].view(dtype)
        if self.used + nbytes > self.batch_bytes:
            self.flush()
        if self.arena is None:
            self.arena = _pinned(self.batch_bytes)
        at = self.used
        self.used += (nbytes + 63) // 64 * 64
        return self.arena[at:at + nbytes].view(dtype)

    def add(self, name, shape, dtype, offsets, sizes, target, done):
        """Box `offsets`/`sizes` of tensor `name` (of `shape`) into `target`; then done()."""
        direct = (target.device.type == "cpu" and target.dtype == dtype
                  and target.is_contiguous() and list(target.shape) == list(sizes))
        if not direct and list(target.shape) != list(sizes):
            raise CkptError(3, f"tensor {name!r}: the target holds {list(target.shape)}, the "
                               f"step {list(sizes)}")
        gpu = target.device.type == "cuda"
        runs = _runs(shape, offsets, sizes)
        span = (runs[-1][0] + runs[-1][1] - runs[0][0]) if runs else 0
        element = torch.empty((), dtype=dtype).element_size()
        if len(runs) > 64 and (span - _numel(sizes)) * element <= _SPAN_SLACK_BYTES:
            # Many short runs close together: one read of their span, then a strided copy.
            whole = self._temp(span, dtype, gpu)
            self.reads.append((name, runs[0][0], whole))
            self.copies.append((target, whole.as_strided(sizes, _strides(shape))))
            self.spare += span * element
        else:
            out = target if direct else self._temp(_numel(sizes), dtype, gpu).view(sizes)
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

    validate_checkpoint_id = classmethod(lambda cls, checkpoint_id: _names_a_step(checkpoint_id))

    def _open(self):
        if self._reader is not None:
            return self._reader
        if self.root is None:
            raise ValueError("ckpt.dcp.StorageReader needs a root: pass it, or a checkpoint_id "
                             "naming <root>/step-<N>")
        if not os.path.isdir(self.root):
            raise CkptError(5, f"{self.root}: no ckpt store there")
        self._store = _open_store(self.root, False, read_only=True)
        step = self.step if self.step is not None else _latest(self._store)
        if step is None:
            raise CkptError(5, f"{self.root}: no committed step (no LATEST)")
        self._reader = _StepReader(self._store, step)
        return self._reader

    def read_metadata(self, *args, **kwargs):
        if kwargs.get("rank") is not None:
            raise CkptError(5, "a ckpt step holds one metadata for the whole job, not per rank")
        reader = self._open()
        metadata = pickle.loads(reader.blob(METADATA_BLOB))
        if not isinstance(metadata, Metadata):
            raise CkptError(15, f"{self.root} step {reader.step}: blob {METADATA_BLOB} is not "
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
                raise CkptError(5, f"step {reader.step}: nothing stored for "
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
