"""ckpt.dcp.StorageWriter: one dcp.save (or dcp.async_save) is one ckpt save transaction, and
one save owns the writer from its set-up to its commit.

Ownership protocol (the writer's lock guards every step's bookkeeping; a save is a _Claim):
O1. Claim. The first call of a save claims the idle writer: stage() (dcp.async_save calls it in
    the caller's thread before handing the save to its own thread), else reset() (DCP's
    checkpoint_id), else set_up_storage_writer(). The claim records the root and step it saves
    to, fixed then: nothing another call does to the writer's attributes afterwards redirects it.
    A claim while another save owns the writer is refused by name (RuntimeError naming the
    owner's root and step), whichever thread makes it.
O2. Adopt. A claim made by stage() is a reservation for the save async_save runs in its thread:
    the first reset/set_up from another thread adopts it (reset's checkpoint_id then names the
    destination: it is the async_save call's own; the writer's own root, step and checkpoint_id
    stay the caller's). The same call from the reserving thread is a second save, refused. A
    claim whose set-up fails (a checkpoint_id naming no path) ends there, a reservation
    included. From then on only the owning thread's calls of DCP's phases are served; any other
    thread's are refused.
O3. Begin. prepare_global_plan (the coordinator) opens the store and begins the step: the
    handles belong to the claim, not to the writer.
O4. Write. write_data writes this rank's items; a rank other than the coordinator opens its own
    handles, votes, and its claim ends there (DCP calls finish on the coordinator only).
O5. Commit. finish commits (or aborts) with the claim's own handles; the claim ends only when the
    commit or the abort has returned, so no handle is freed under the thread that uses it.
O6. Close and abandon. A phase running (O3-O5) holds the claim active: close() then is refused.
    Otherwise close() abandons the save only when no thread can still run it: the caller's own
    save (a dcp.save that failed before its finish), or one whose thread has ended (an
    async_save that failed); a reservation not yet adopted, or a save of another live thread, is
    refused by name. A new claim from the owner's own thread (its previous save failed before
    finishing) or over an ended thread's save abandons that save first (the staging directory
    goes; nothing was published).
"""
import contextlib
import ctypes
import dataclasses
import io
import pickle
import threading
import weakref

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter as _DcpWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from . import _dcp_common as common
from . import _lib
from ._lib import CkptError, Code, lib
from ._native import Native
from .checkpointer import hand_back

# The write result that carries a rank's vote (O4); never part of the stored metadata.
_VOTE_INDEX = MetadataIndex("ckpt.dcp.vote")
# How long close() waits for a thread whose save has ended to be gone (a thread executor lets
# its worker go just after the save's future is set).
_ENDED_THREAD_WAIT_S = 2.0


class _Relay:
    """The ckpt coordinator of one rank's part in a DCP save: DCP's own exchanges carry the
    store protocol's, so each all-gather is answered from what DCP delivered (O3's begin
    message, O4's votes) and what this rank hands to it is kept (its vote)."""

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
        common.check_code(lib.ckpt_save_begin(store.handle, step, ctypes.byref(
            self.relay.table), ctypes.byref(handle)), f"begin saving step {step}")
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
        common.check_code(lib.ckpt_save_declare(self.native.handle,
                                                _lib.encode_text(name, "tensor"),
                                                common.DTYPES[dtype], dims, len(shape)),
                          f"declaring tensor {name!r}")
        self._declared[name] = (dtype, tuple(shape))

    def write(self, name, begin, tensor):
        count = tensor.numel()
        if count == 0:
            return
        common.check_code(lib.ckpt_save_write(self.native.handle,
                                              _lib.encode_text(name, "tensor"), begin, count,
                                              tensor.data_ptr(),
                                              count * tensor.element_size()),
                          f"writing elements [{begin}, {begin + count}) of tensor {name!r}")

    def write_blob(self, name, data):
        raw = bytes(data)
        common.check_code(lib.ckpt_save_write_blob(self.native.handle,
                                                   _lib.encode_text(name, "blob"), raw,
                                                   len(raw)), f"writing blob {name!r}")

    def vote(self):
        """Rank ≠ 0: syncs this rank's data and part and returns its vote (O4)."""
        code = lib.ckpt_save_commit(self.native.handle)  # The relay refuses the exchange.
        self.native.close()
        if len(self.relay.said) < 2:
            common.check_code(code, f"rank {self.rank}: finishing step {self.step}")
            raise CkptError(Code.INTERNAL,
                            f"rank {self.rank}: the commit of step {self.step} cast no vote")
        return self.relay.said[1]

    def commit(self, votes):
        """Rank 0: commits with every rank's vote (O5)."""
        self.relay.answers.append(lambda mine: [mine] + list(votes))
        self.relay.answers.append(lambda mine: [mine] + [b""] * (self.size - 1))
        try:
            common.check_code(lib.ckpt_save_commit(self.native.handle),
                              f"committing step {self.step}")
        finally:
            self.native.close()

    def abort(self):
        # No answer to its exchange: rank 0 then removes the staging directory itself.
        self.native.close()


class _Claim:
    """One save's hold on a writer (O1-O6): where it saves, which thread runs it, the handles
    it opened, and whether one of its phases is running."""

    def __init__(self, root, step, thread=None, reserved_by=None):
        self.root, self.step = root, step
        self.thread = thread  # The thread that runs the save's phases (None: reserved).
        self.reserved_by = reserved_by  # The thread whose stage() reserved it.
        self.phase = "reserved" if thread is None else None
        self.active = 0
        self.store = self.save = None
        self.coordinator = True

    def name(self):
        if self.root is None:
            return "dcp.async_save's save (its thread has not named its checkpoint yet)"
        return f"the save of step {self.step} to {self.root}"

    def release(self):
        """Lets go of the save (aborted unless committed) and the store. REQUIRES: inactive."""
        save, store = self.save, self.store
        self.save = self.store = None
        if save is not None:
            save.abort()
        if store is not None:
            store.close()

    def ended(self):
        return self.thread is not None and not self.thread.is_alive()


class StorageWriter(_DcpWriter):
    """DCP storage writer over ckpt store `root`: each dcp.save (or dcp.async_save) commits
    step `step` wholly or not at all. `root` and `step` may instead come from the checkpoint_id
    DCP passes ("<root>/step-<N>"). `keep_last`/`keep_every`: the store's retention after each
    commit (0: keep every step).

    One save at a time: from its set-up (dcp.async_save's call included) to its commit, a
    second save through this writer, reset() to another checkpoint_id and close() are refused
    by name (RuntimeError); use one writer per save in flight."""

    # dcp.async_save stages through the writer (stage()), in the caller's thread: the writer
    # is claimed there, before the save's thread starts (O1).
    _synchronize_after_execute = False

    def __init__(self, root=None, step=None, *, keep_last=0, keep_every=0):
        super().__init__()
        self.root, self.step = root, step
        self.keep_last, self.keep_every = keep_last, keep_every
        self.checkpoint_id = None
        self.is_coordinator = True
        self._use_collectives = True
        self._lock = threading.Lock()
        self._claim = None
        # A hook tests use to stop a save at a point of the protocol: hook(point) with point in
        # reset, set_up, local_plan, global_plan, write_data, finish (each called as the phase
        # is entered, before it claims or is served), commit (inside finish, the claim active).
        self._hook = None
        finalizer = weakref.finalize(self, StorageWriter._release, self.__dict__)
        finalizer.atexit = False

    @staticmethod
    def _release(state):
        claim = state.get("_claim")
        state["_claim"] = None
        if claim is not None:
            claim.release()

    def _at(self, point):
        if self._hook is not None:
            self._hook(point)

    @property
    def should_synchronize_after_execute(self):
        return False

    def synchronize_staging(self):
        pass  # stage() copies before it returns.

    def close(self):
        """Abandons a save DCP did not finish (call it after a dcp.save that failed before its
        finish, to let go of the store's LOCK at once) and lets go of the store. Refused while
        a save through this writer runs in another thread (O6)."""
        with self._lock:
            claim = self._claim
            if claim is not None and claim.thread is not threading.current_thread() and \
                    not claim.ended() and claim.active == 0 and claim.thread is not None:
                self._lock.release()
                try:
                    claim.thread.join(_ENDED_THREAD_WAIT_S)
                finally:
                    self._lock.acquire()
                claim = self._claim
            if claim is not None:
                self._refuse_unless_abandonable(claim, "close()")
            StorageWriter._release(self.__dict__)

    def _refuse_unless_abandonable(self, claim, what):
        """O6: the claim may go only when no thread can still run its save."""
        mine = claim.thread is threading.current_thread()
        if claim.active or not (mine or claim.ended()):
            how = ("dcp.async_save has not started it yet" if claim.thread is None
                   else "it runs in another thread (dcp.async_save: wait for its future)")
            raise RuntimeError(f"ckpt.dcp.StorageWriter: {what} refused: {claim.name()} through "
                               f"this writer has not finished ({how}); "
                               "use one writer per save in flight")

    # --- O1, O2: claiming ---------------------------------------------------------------------

    def stage(self, state_dict):
        """dcp.async_save's staging, in the caller's thread: claims the writer for the save
        about to start (O1) and returns a CPU copy of `state_dict` (the caller may then change
        its tensors)."""
        with self._lock:
            self._claim_idle("dcp.async_save", _Claim(self.root, self.step,
                                                      reserved_by=threading.current_thread()))
            claim = self._claim
        try:
            return _stage_on_cpu(state_dict)
        except BaseException:
            with self._lock:
                if self._claim is claim:
                    self._claim = None
            raise

    def _claim_idle(self, what, claim):
        """Under the lock: `claim` becomes the writer's, or RuntimeError naming the owner."""
        old = self._claim
        if old is not None:
            self._refuse_unless_abandonable(old, what)
            old.release()
        self._claim = claim

    def _take(self, what):
        """reset / set_up_storage_writer (O1, O2): this thread's claim, adopted or made; and
        whether it was adopted from a reservation."""
        me = threading.current_thread()
        claim = self._claim
        if claim is not None and claim.thread is None and claim.reserved_by is not me:
            claim.thread = me  # O2: the reserved save's own thread.
            return claim, True
        if claim is None or claim.thread is not me or claim.phase not in (None, "reset"):
            claim = _Claim(self.root, self.step, thread=me)
            self._claim_idle(what, claim)
        return claim, False

    def _drop(self, claim):
        """Under the lock: a claim whose set-up failed ends (it holds no handles yet)."""
        if self._claim is claim:
            self._claim = None
        claim.release()

    def reset(self, checkpoint_id=None):
        self._at("reset")
        with self._lock:
            claim, adopted = self._take(f"reset({checkpoint_id!r})")
            try:
                root = step = None
                if checkpoint_id is not None:
                    root, step = common.split_checkpoint_id(checkpoint_id)
            except BaseException:
                self._drop(claim)  # An async save's reservation too: nothing holds the writer.
                raise
            claim.phase = "reset"
            if root is not None:
                claim.root = root
                if step is not None:
                    claim.step = step
                # The writer's own attributes follow a save of the caller's thread only: an
                # async save's thread, at a moment of its own, must not change what the
                # caller's next save without a checkpoint_id goes to.
                if not adopted:
                    self.checkpoint_id, self.root = checkpoint_id, root
                    if step is not None:
                        self.step = step

    validate_checkpoint_id = classmethod(
        lambda cls, checkpoint_id: common.names_a_step(checkpoint_id))

    def set_up_storage_writer(self, is_coordinator, *args, **kwargs):
        self._at("set_up")
        use_collectives = kwargs.get("use_collectives", True)
        dist = torch.distributed
        with self._lock:
            claim, _ = self._take("a save")
            if not use_collectives and dist.is_available() and dist.is_initialized() and \
                    dist.get_world_size() > 1:
                self._drop(claim)
                # Each rank would commit its own chunks as the whole step.
                raise ValueError("ckpt.dcp.StorageWriter commits one step for the whole job: "
                                 "it needs DCP's collectives (use_collectives=True)")
            claim.phase = "set_up"
            claim.coordinator = is_coordinator
            self.is_coordinator = is_coordinator
            self._use_collectives = use_collectives

    # --- O3-O5: the phases, served to the owning thread only -----------------------------------

    @contextlib.contextmanager
    def _phase(self, name, point):
        self._at(point)
        me = threading.current_thread()
        with self._lock:
            claim = self._claim
            if claim is None or claim.thread is not me:
                owner = f" (it runs {claim.name()} for another thread)" if claim else ""
                raise RuntimeError(f"ckpt.dcp.StorageWriter: {name} of a save this writer was "
                                   f"not set up for{owner}")
            claim.active += 1
        try:
            yield claim
        finally:
            with self._lock:
                claim.active -= 1

    def _end(self, claim):
        """The claim's save is over (committed, aborted or voted): the writer is free."""
        with self._lock:
            if self._claim is claim:
                self._claim = None
        claim.release()

    def prepare_local_plan(self, plan):
        # O1 done: the plan says whether this rank is DCP's coordinator.
        with self._phase("prepare_local_plan", "local_plan") as claim:
            return dataclasses.replace(plan, storage_data={"coordinator": claim.coordinator})

    def prepare_global_plan(self, plans):
        # O3.
        claim = None
        try:
            with self._phase("prepare_global_plan", "global_plan") as claim:
                return self._begin(claim, plans)
        except BaseException:
            if claim is not None:
                self._end(claim)  # DCP skips finish: nothing may hold the store meanwhile.
            raise

    def _begin(self, claim, plans):
        if claim.root is None or claim.step is None:
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
        claim.release()
        claim.store = common.open_store(claim.root, True, keep_last=self.keep_last,
                                        keep_every=self.keep_every)
        claim.save = _Save(claim.store, claim.step, 0, size)
        claim.phase = "planned"
        return [dataclasses.replace(plan, storage_data={
                    "begin": claim.save.begin_message, "rank": (i - me) % size, "size": size,
                    "step": claim.step}) for i, plan in enumerate(plans)]

    def write_data(self, plan, planner):
        # O4.
        with self._phase("write_data", "write_data") as claim:
            results = self._write(claim, plan, planner)
        if not claim.coordinator:
            self._end(claim)  # DCP calls finish on the coordinator only.
        future = Future()
        future.set_result(results)
        return future

    def _write(self, claim, plan, planner):
        where = plan.storage_data
        results, error = [], None
        save = claim.save
        try:
            if not isinstance(where, dict) or "rank" not in where:
                raise RuntimeError("this DCP plan was not prepared by ckpt.dcp.StorageWriter")
            if claim.step is not None and where["step"] != claim.step:
                raise RuntimeError(f"this rank's writer saves step {claim.step}, the "
                                   f"coordinator's step {where['step']}")
            if where["rank"] != 0:
                claim.release()
                claim.store = common.open_store(claim.root, False)
                save = claim.save = _Save(claim.store, where["step"], where["rank"],
                                          where["size"], where["begin"])
            claim.phase = "writing"
            _write_items(save, plan.items, planner, results)
        except Exception as e:  # Travels to finish as this rank's result (O4).
            error = f"{type(e).__name__}: {e}"
        vote = None
        if save is not None and save.rank != 0:
            try:
                vote = save.vote()
            except Exception as e:
                error = error or f"{type(e).__name__}: {e}"
            claim.release()
        rank = where.get("rank") if isinstance(where, dict) else None
        results.append(WriteResult(index=_VOTE_INDEX, size_in_bytes=0,
                                   storage_data=(rank, vote, error)))
        return results

    def finish(self, metadata, results):
        # O5.
        claim = None
        try:
            with self._phase("finish", "finish") as claim:
                self._commit(claim, metadata, results)
        finally:
            if claim is not None:
                self._end(claim)

    def _commit(self, claim, metadata, results):
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
        save = claim.save
        if save is None:
            raise CkptError(Code.FAILED_PRECONDITION,
                            f"ckpt.dcp.StorageWriter: finish of {claim.name()} without a "
                            "transaction in progress")
        if errors:
            raise CkptError(Code.ABORTED, f"step {save.step} not saved: " + "; ".join(errors))
        if sorted(votes) != list(range(1, save.size)):
            raise CkptError(Code.ABORTED, f"step {save.step} not saved: ranks {sorted(votes)} of "
                                f"1..{save.size - 1} voted")
        metadata.storage_data = storage
        save.write_blob(common.METADATA_BLOB, pickle.dumps(metadata))
        self._at("commit")
        claim.save = None  # Committed or failed, the commit closes it.
        save.commit([votes[r] for r in range(1, save.size)])

    def storage_meta(self):
        return None


def _stage_on_cpu(state_dict):
    """What dcp.async_save stages with when the writer does not: a CPU copy, blocking."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:  # A torch before DefaultStager.
        from torch.distributed.checkpoint.staging import BlockingAsyncStager
        return BlockingAsyncStager().stage(state_dict)
    stager = DefaultStager(StagingOptions(False, False, False, False))
    try:
        return stager.stage(state_dict)
    finally:
        stager.close()


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
            slots[turn] = common.pinned(nbytes)
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
        if dtype not in common.DTYPES:
            raise TypeError(f"tensor {item.index.fqn!r} is {dtype}, which a ckpt store does not "
                            f"hold (it holds {', '.join(str(d) for d in common.DTYPES)})")
        tensor = data.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.to("cpu")
        tensor = tensor.contiguous()
        name = common.store_name(item.index.fqn)
        flat = common.flat_range(shape, offsets, sizes)
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
