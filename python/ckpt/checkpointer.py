"""ckpt.Checkpointer: a StagedAdamW's state saved and loaded as ckpt transactions.

Every call is collective over the job's ranks (one process: nothing to coordinate; several:
torch.distributed's default group, or the one given). A save is committed on every rank or on
none; `save_async` returns at once and `finalize()` commits; a load that fails anywhere leaves
the optimizer and the parameters exactly as they were (or poisoned: it then refuses to step
until a load succeeds), and raises CkptError with ckpt's message.

`extra` is the trainer's own state (LR scheduler, RNG, data position): a dict, stored with
pickle beside the optimizer's state, per rank, and returned by `load`. Like torch.load, loading
unpickles: load only checkpoints you trust.

Every save has an identity (`save_id`: a random session of this Checkpointer, agreed by its
ranks, and a count), recorded in the step (blob "ckpt.save_id") and returned by save() and
save_async(): `load(step, save_id=...)` loads that save only, whatever else was saved since as
the same step number, and `state_id` says which save the optimizer's state provably equals now
(the last one saved or loaded, with no step, load or edit since), or None.

Ctrl-C (SIGINT, and SIGTERM where Python handles it) cannot cut a call in half: once a call has
checked its arguments, the signal is deferred (ckpt/_signals.py) until what the C call did is
reflected in Python too (parameters, param_groups, loaded_step and loaded_extra after a load; the
PendingSave recorded as `pending` after save_async), and is delivered then.
"""
import ctypes
import os
import pickle
import re
import weakref

from . import _lib, _signals
from ._lib import CkptError, Code, check, lib
from ._native import Native

_EXTRA = "python.extra"
# The identity of the save a step holds (every rank's blob; rank 0's is read).
SAVE_ID = "ckpt.save_id"
# How a Checkpointer's blobs are named in a step (optimizer/state_layout.h kTrainerPrefix).
_STORED_PREFIX = b"trainer."
_SAVE_ID = re.compile(r"[0-9a-f][0-9a-f-]{0,63}")


def check_save_id(save_id):
    """A save identity as ckpt writes them (lower-case hex and '-', at most 64), else a
    ValueError."""
    if not isinstance(save_id, str) or not _SAVE_ID.fullmatch(save_id):
        raise ValueError(f"a save identity is a str of hex digits and '-', not {save_id!r}")
    return save_id


def agreed_session(group):
    """A random session name, the same on every rank of `group` (None: this process alone;
    collective otherwise)."""
    mine = os.urandom(8).hex()
    if group is None:
        return mine
    import torch.distributed as dist
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, mine, group=group)
    return parts[0]


def step_save_id(store_handle, step):
    """The identity of the save committed step `step` of an open store holds, or None for a
    step saved before ckpt recorded one. CkptError when the step cannot be opened (NOT_FOUND
    when there is none)."""
    reader = ctypes.c_void_p()
    check(lib.ckpt_reader_open(store_handle, step, ctypes.byref(reader)))
    try:
        size = ctypes.c_size_t()
        name = _STORED_PREFIX + SAVE_ID.encode()
        code = lib.ckpt_reader_blob(reader, name, 0, None, 0, ctypes.byref(size))
        if code == Code.NOT_FOUND:  # No identity recorded.
            return None
        check(code)
        buf = ctypes.create_string_buffer(max(1, size.value))
        check(lib.ckpt_reader_blob(reader, name, 0, buf, size.value, ctypes.byref(size)))
        return buf.raw[:size.value].decode("ascii", "replace")
    finally:
        lib.ckpt_reader_close(reader)


def hand_back(parts, out, lens):
    """An all_gather callback's answer: every rank's bytes (`parts`, in rank order) back to back
    in memory ckpt frees, their lengths in `lens`. 0, or 1 when that memory is not there."""
    buf = lib.ckpt_alloc(sum(len(p) for p in parts))
    if not buf:
        return 1
    at = 0
    for r, part in enumerate(parts):
        ctypes.memmove(buf + at, part, len(part))
        lens[r] = len(part)
        at += len(part)
    out[0] = buf
    return 0


def _torch_coordinator(group):
    """A ckpt coordinator over torch.distributed (gloo or NCCL): all-gathers bytes."""
    import torch.distributed as dist

    rank, size = dist.get_rank(group), dist.get_world_size(group)

    def all_gather(_user, data, length, out, lens):
        try:
            mine = ctypes.string_at(data, length) if length else b""
            parts = [None] * size
            dist.all_gather_object(parts, mine, group=group)
            return hand_back(parts, out, lens)
        except Exception:  # A failed exchange is the vote's error, not a crash of the caller.
            return 1

    def barrier(_user):
        try:
            dist.barrier(group=group)
            return 0
        except Exception:  # Reported to ckpt as a failed barrier, not raised through C.
            return 1

    callbacks = (_lib.ALL_GATHER(all_gather), _lib.BARRIER(barrier))
    return _lib.Coordinator(None, rank, size, *callbacks), callbacks


class PendingSave:
    """An async save in flight: finalize() (collective) commits it or raises."""

    def __init__(self, checkpointer, native, step, save_id, generation):
        self._checkpointer, self._native, self.step = checkpointer, native, step
        self.save_id = save_id
        self._generation = generation  # The optimizer's, at the call (the state saved).
        self._finalized = False

    @property
    def writer_done(self):
        if self._native.closed:
            return True
        done = ctypes.c_int()
        check(lib.ckpt_pending_save_writer_done(self._native.handle, ctypes.byref(done)))
        return bool(done.value)

    def finalize(self):
        """Collective. Waits for the writer and commits on every rank or on none; raises
        CkptError otherwise. Either way the native handle is released exactly once: a Ctrl-C
        comes either before the call began (finalize can be called again) or after it was
        finalized and released."""
        if self._finalized:
            raise CkptError(Code.FAILED_PRECONDITION,
                            f"the async save of step {self.step} is already finalized")
        if self._native.closed:
            raise CkptError(Code.FAILED_PRECONDITION,
                            f"the async save of step {self.step}: its checkpointer is closed "
                            "(the save was abandoned)")
        with _signals.deferred():
            self._finalized = True
            if self._checkpointer._pending is self:
                self._checkpointer._pending = None
            try:
                check(lib.ckpt_pending_save_finalize(self._native.handle))
                self._checkpointer._undo_step = self.step
                self._checkpointer._state = (self.save_id, self._generation)
            finally:
                self._native.close()


class Checkpointer:
    """Saves and loads `optimizer` (a ckpt.torch.StagedAdamW) in the checkpoint root `root`.

    process_group: the group the optimizer shards its state over (the default: the optimizer's
    own; one process when it has none). With a non-sharded optimizer in a DDP job, every rank
    holds the whole state: make the Checkpointer on one rank only (the others would be refused
    the root's LOCK).
    async_staging_bytes: memory an async save may use to copy state aside (0: 1 GiB).
    keep_last, keep_every: retention after each commit: keep the newest keep_last steps (0: every
    step) and every step that is a multiple of keep_every (0: none for this reason); the step
    LATEST names is always kept. The old steps' files are removed in the background, so a save
    (or finalize) does not wait for them.
    read_only: open the root for reading only (no LOCK taken, no recovery, nothing written), e.g.
    on a read-only file system or beside the job that owns it: load and load_model work, save
    and save_async raise CkptError (FAILED_PRECONDITION); keep_last/keep_every are a ValueError.
    root is a str, bytes or os.PathLike; one with a NUL byte is a ValueError.
    After a load, `loaded_step` and `loaded_extra` hold its step and extra (None before).
    """

    def __init__(self, root, optimizer, *, process_group=None, async_staging_bytes=0,
                 keep_last=0, keep_every=0, read_only=False):
        for name, value in (("keep_last", keep_last), ("keep_every", keep_every),
                            ("async_staging_bytes", async_staging_bytes)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, not {value!r}")
        if not isinstance(read_only, bool):
            raise ValueError(f"read_only must be a bool, not {read_only!r}")
        if read_only and (keep_last or keep_every):
            raise ValueError("keep_last and keep_every remove old steps: a Checkpointer opened "
                             "with read_only=True removes nothing")
        root_bytes = _lib.encode_path(root, "root")
        self._optimizer = optimizer
        self._store = None  # Natives (ckpt/_native.py): the store, then the checkpointer.
        self._native = None
        self._pending = None
        self._root, self.read_only = root, read_only
        self.loaded_step = self.loaded_extra = self.loaded_save_id = None
        # (save identity, optimizer generation): the save the state last equalled, and the
        # optimizer's generation (StagedAdamW._generation) right then.
        self._state = None
        self._saves = 0
        # The step the optimizer's state last equalled (saved as, or loaded from): the undo
        # source of the next load, which keep_only keeps.
        self._undo_step = None
        self.skipped_steps = 0
        coordinator = None
        rank = 0
        if process_group is None:
            process_group = optimizer._group_handle
        elif process_group is not optimizer._group_handle:
            # Each rank must own its pieces of the state; with whole parameters on every rank,
            # the ranks' saves would overlap.
            raise ValueError("the Checkpointer's process_group must be the one its StagedAdamW "
                             "shards its state over")
        distributed = process_group is not None
        callbacks = ()
        if distributed:
            coordinator, callbacks = _torch_coordinator(process_group)
            rank = coordinator.rank
        self._rank = rank
        store = ctypes.c_void_p()
        options = _lib.StoreOptions(ctypes.sizeof(_lib.StoreOptions), 1 if rank == 0 else 0,
                                    1 if read_only else 0, keep_last, keep_every, 0)
        if distributed:
            # Collective: rank 0's primary creates and recovers the root before the others open
            # it, and every rank gets its handle or every rank raises.
            check(lib.ckpt_store_open_on_ranks(root_bytes, ctypes.byref(options),
                                               ctypes.byref(coordinator), ctypes.byref(store)))
        else:
            check(lib.ckpt_store_open_with(root_bytes, ctypes.byref(options),
                                           ctypes.byref(store)))
        self._store = Native(store, lib.ckpt_store_close, "checkpointer", collective=distributed)
        handle = ctypes.c_void_p()
        try:
            self._session = agreed_session(process_group)
            opt = optimizer._live()
            check(lib.ckpt_checkpointer_open(
                opt, store, ctypes.byref(coordinator) if coordinator is not None else None,
                int(async_staging_bytes), ctypes.byref(handle)))
        except BaseException:
            self.close()  # Lets go of the root's LOCK.
            raise
        # Closed before the optimizer's slabs and the store (its parents), with the callbacks
        # it calls kept alive as long as it is; closing it (or the optimizer) closes the store.
        self._native = Native(handle, lib.ckpt_checkpointer_destroy, "checkpointer",
                              parents=(optimizer._native, self._store), keep=callbacks,
                              collective=distributed, then_close=(self._store,))
        # The optimizer's load_state_dict refuses while one of its checkpointers has an async
        # save in flight (every rank alike, before any rank changes anything).
        optimizer._layout.setdefault("checkpointers", weakref.WeakSet()).add(self)
        # Its optimizer holds the Native (a parent holds its open children), so dropping the
        # last reference to this object must close it: the root's LOCK, the staging pool and
        # an abandoned save's fence go with it. Not at exit: the exit hook decides there.
        finalizer = weakref.finalize(self, self._native.close)
        finalizer.atexit = False

    def _live(self):
        if self._native is None:
            raise CkptError(Code.FAILED_PRECONDITION, "the checkpointer is closed")
        handle = self._native.handle
        self._optimizer._live()
        return handle

    @staticmethod
    def _step(step):
        if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 2 ** 64:
            raise ValueError(f"step must be an int in [0, 2**64), got {step!r}")
        return step

    def _settle(self):
        """A previous async save still in flight is finalized first (collective: every rank
        makes the same calls), so that dropping its handle cannot wedge the checkpointer."""
        if self._pending is not None:
            self._pending.finalize()

    @staticmethod
    def _blobs(extra, save_id):
        data = [pickle.dumps(extra if extra is not None else {}), save_id.encode()]
        keys = (ctypes.c_char_p * 2)(_EXTRA.encode(), SAVE_ID.encode())
        values = (ctypes.c_void_p * 2)(*[ctypes.cast(ctypes.c_char_p(d), ctypes.c_void_p)
                                         for d in data])
        lens = (ctypes.c_size_t * 2)(*[len(d) for d in data])
        return keys, values, lens, data

    def _begin_save(self, step, extra, save_id):
        """What save and save_async do before their critical section: checks, the extra state
        pickled as one blob and the save's identity as another, the in-flight save finalized
        (in its own section)."""
        step = self._step(step)
        if save_id is None:
            save_id = f"{self._session}-{self._saves:x}"
        check_save_id(save_id)
        if self.read_only:
            raise CkptError(Code.FAILED_PRECONDITION,
                            f"{self._root}: cannot save step {step}: the Checkpointer was "
                            "opened with read_only=True")
        handle = self._live()
        blob = self._blobs(extra, save_id)
        self._settle()
        return (handle, step, save_id) + blob

    def _hand_over(self):
        """The hyper-parameters handed to ckpt, first thing in a save's section (the weights
        saved are ckpt's masters rounded, which every step writes into the parameters)."""
        self._optimizer._push_groups()

    def save(self, step, extra=None, *, save_id=None):
        """Collective. Saves the state as it is now as `step` (newer than LATEST); returns the
        save's identity (`save_id` when given: hex digits and '-', the same on every rank; else
        one made here). Raises CkptError when the save failed (nothing committed) or the
        Checkpointer is read-only. A Ctrl-C comes either before the save began or after it
        committed (or failed)."""
        handle, step, save_id, keys, values, lens, keep = self._begin_save(step, extra, save_id)
        with _signals.deferred():
            self._hand_over()
            generation = self._optimizer._generation()
            self._saves += 1
            check(lib.ckpt_checkpointer_save(handle, step, keys, values, lens, 2))
            self._undo_step = step
            self._state = (save_id, generation)
        del keep
        return save_id

    def save_async(self, step, extra=None, *, save_id=None):
        """Collective. Begins saving the state as it is now as `step`; steps may run meanwhile.
        Returns a PendingSave (its save_id: the save's identity, as save() returns it); its
        finalize() (collective) commits. A save still in flight is finalized first. A Ctrl-C
        comes either before the save began or after its PendingSave was recorded as `pending`
        (finalize it from there, or the next call will)."""
        handle, step, save_id, keys, values, lens, keep = self._begin_save(step, extra, save_id)
        with _signals.deferred():
            self._hand_over()
            generation = self._optimizer._generation()
            self._saves += 1
            native = ctypes.c_void_p()
            check(lib.ckpt_checkpointer_save_async(handle, step, keys, values, lens, 2,
                                                   ctypes.byref(native)))
            owner = Native(native, lib.ckpt_pending_save_destroy, "async save",
                           parents=(self._native,), collective=self._native.collective)
            pending = self._pending = PendingSave(self, owner, step, save_id, generation)
        del keep
        return pending

    @property
    def pending(self):
        """The async save in flight (save_async's PendingSave, not finalized yet), or None."""
        return self._pending

    def load(self, step=None, *, fallback=False, save_id=None):
        """Collective. Loads `step` (LATEST when None) into the optimizer and the parameters, at
        any data-parallel size; returns the `extra` saved with it by this rank (by rank 0 when
        the checkpoint was saved by fewer ranks than this rank's number), also kept as
        `loaded_extra` (and the step as `loaded_step`). A Ctrl-C comes either before the load
        began (nothing changed) or after all of it was applied: state, parameters,
        param_groups, loaded_step and loaded_extra.
        fallback=True (with step None): when LATEST fails on damage (DATA_LOSS), each older
        step is tried in turn, newest first, and the newest that loads intact is loaded;
        `skipped_steps` then counts the newer ones passed over. Without it, such a load raises
        DATA_LOSS naming the chunk and saying how to go on.
        save_id (with a step): load that step only if it holds that save (save() returned it);
        otherwise NOT_FOUND naming both, nothing changed (the step was saved again since, e.g.
        by a run resumed from an older step into the same store). `loaded_save_id` holds the
        identity of the save loaded (None for a step saved before ckpt recorded one)."""
        if step is not None:
            step = self._step(step)
        if not isinstance(fallback, bool):
            raise ValueError(f"fallback must be a bool, not {fallback!r}")
        if fallback and step is not None:
            raise ValueError("fallback=True walks back from LATEST: give no step")
        if save_id is not None:
            check_save_id(save_id)
            if step is None:
                raise ValueError("save_id names the save of one step: give the step too")
        handle = self._live()
        self._settle()
        if save_id is not None:
            self._expect_save(step, save_id)
        with _signals.deferred():
            blobs = ctypes.c_void_p()
            loaded = ctypes.c_uint64()
            if fallback:
                skipped = ctypes.c_uint64()
                check(lib.ckpt_checkpointer_load_newest_intact(
                    handle, ctypes.byref(blobs), ctypes.byref(loaded), ctypes.byref(skipped)))
                self.skipped_steps = skipped.value
            else:
                check(lib.ckpt_checkpointer_load(handle, 0 if step is None else 1,
                                                 0 if step is None else int(step),
                                                 ctypes.byref(blobs), ctypes.byref(loaded)))
                self.skipped_steps = 0
            try:
                # The state is loaded: the parameters and param_groups follow it before
                # anything else can fail.
                self._optimizer._publish_weights()
                self._optimizer._pull_groups()
                self.loaded_step, self.loaded_extra = loaded.value, None
                self._undo_step = loaded.value
                raw = self._extra_blob(blobs)
                found = self._extra_blob(blobs, SAVE_ID)
                self.loaded_save_id = found.decode("ascii", "replace") if found else None
                self._state = (self.loaded_save_id, self._optimizer._generation())
            finally:
                lib.ckpt_blobs_free(blobs)
            self.loaded_extra = self._unpickle(raw, loaded.value)
        return self.loaded_extra

    def _expect_save(self, step, save_id):
        """NOT_FOUND, on every rank alike, unless committed step `step` holds save `save_id`."""
        error = None
        try:
            found = step_save_id(self._store.handle, step)
            if found != save_id:
                raise CkptError(Code.NOT_FOUND, f"{self._root}: step {step} holds save "
                                   f"{found or '(no identity: saved by an older ckpt)'}, not save "
                                   f"{save_id} that was asked for: the step was saved again "
                                   "since (a run resumed from an older step into this store?); "
                                   "the save asked for was set aside into quarantine/ if it "
                                   "existed, and is never loaded in its place")
        except CkptError as e:
            error = e
        if self._native.collective and self._optimizer._any_rank(error is not None) and \
                error is None:
            error = CkptError(Code.NOT_FOUND,
                              f"{self._root}: another rank refused loading step {step} as "
                              f"save {save_id}; nothing was loaded")
        if error is not None:
            raise error

    @property
    def state_id(self):
        """The identity of the save the optimizer's state provably equals now: the last one
        this Checkpointer saved (committed) or loaded, when no step, load or edit of a
        parameter happened since; None otherwise (or for a step saved without identity)."""
        if self._state is None or self._native is None or self._native.closed:
            return None
        save_id, generation = self._state
        now = self._optimizer._generation()
        return save_id if now == generation else None

    def save_id_of(self, step):
        """The identity of the save committed step `step` holds (None: saved before ckpt
        recorded one); CkptError NOT_FOUND when there is no such step."""
        step = self._step(step)
        if self._store is None:
            raise CkptError(Code.FAILED_PRECONDITION, "the checkpointer is closed")
        return step_save_id(self._store.handle, step)

    @staticmethod
    def _extra_blob(blobs, name=_EXTRA):
        """Blob `name` (the pickled extra state) among a load's blobs, or None."""
        count = ctypes.c_size_t()
        check(lib.ckpt_blobs_count(blobs, ctypes.byref(count)))
        for i in range(count.value):
            key, value, length = ctypes.c_char_p(), ctypes.c_void_p(), ctypes.c_size_t()
            check(lib.ckpt_blobs_get(blobs, i, ctypes.byref(key), ctypes.byref(value),
                                     ctypes.byref(length)))
            if key.value == name.encode():
                return ctypes.string_at(value, length.value)
        return None

    @staticmethod
    def _unpickle(raw, step):
        if raw is None:
            return {}
        try:
            return pickle.loads(raw)
        except Exception as e:
            raise CkptError(Code.DATA_LOSS, f"step {step} loaded, but its extra state does not "
                                f"unpickle here: {e!r}") from e

    def load_model(self, source, rename=None, ignore_unexpected=False, masters=False):
        """Collective. Model-only load from a .safetensors file, a HuggingFace directory or a
        ckpt root: masters and parameters from the file, moments zero, steps 0; learning rates
        and everything else untouched. rename: (pattern, replacement) RE2 rules, in order.
        masters: from a ckpt root, each parameter's FP32 master rather than its weights (what
        keeps a checkpoint's training across optimizers of another algorithm, AdamW and Muon).
        A source (str, bytes or os.PathLike) or rule with a NUL byte is a ValueError. A Ctrl-C
        comes either before the load began or after the parameters followed it."""
        source_bytes = _lib.encode_path(source, "source")
        rules = list(rename or [])
        patterns = (ctypes.c_char_p * max(1, len(rules)))(
            *[_lib.encode_text(p, "rename pattern") for p, _ in rules])
        replacements = (ctypes.c_char_p * max(1, len(rules)))(
            *[_lib.encode_text(r, "rename replacement") for _, r in rules])
        handle = self._live()
        self._settle()
        with _signals.deferred():
            check(lib.ckpt_checkpointer_load_model(handle, source_bytes, patterns,
                                                   replacements, len(rules),
                                                   (_lib.LOAD_MODEL_IGNORE_UNEXPECTED
                                                    if ignore_unexpected else 0) |
                                                   (_lib.LOAD_MODEL_MASTERS if masters else 0)))
            self._undo_step = None  # The state equals no step now.
            self._state = None
            self._optimizer._publish_weights()

    def keep_only(self, steps):
        """Collective. Retention by the caller's list: every committed step is removed but
        LATEST, those of `steps`, and the step the optimizer's state was last saved as or
        loaded from (the undo source of the next load). For a trainer whose own rotation
        decides which checkpoints exist (HF Trainer's save_total_limit). An async save in
        flight is finalized first. Rank 0 removes (the others' handles only read); returns how
        many steps went there (0 elsewhere)."""
        keep = {self._step(s) for s in steps}
        self._live()
        if self.read_only:
            raise CkptError(Code.FAILED_PRECONDITION,
                            f"{self._root}: keep_only removes steps: the Checkpointer was "
                            "opened with read_only=True")
        self._settle()
        if self._undo_step is not None:
            keep.add(self._undo_step)
        if self._rank != 0:
            return 0
        ordered = sorted(keep)
        array = (ctypes.c_uint64 * max(1, len(ordered)))(*ordered)
        retired = ctypes.c_size_t()
        with _signals.deferred():
            check(lib.ckpt_store_keep_only(self._store.handle, array, len(ordered),
                                           ctypes.byref(retired)))
        return retired.value

    def adopt(self, step):
        """Collective. Makes LATEST name the committed `step` (every chunk verified first), e.g.
        an older step a run resumed from, so that its next saves are accepted (a save must be
        newer than LATEST). The newer steps stay on disk: a later save of the same number moves
        its predecessor into quarantine/, never deletes it. An async save in flight is
        finalized first; rank 0's handle changes LATEST."""
        step = self._step(step)
        self._live()
        if self.read_only:
            raise CkptError(Code.FAILED_PRECONDITION,
                            f"{self._root}: adopt changes LATEST: the Checkpointer was opened "
                            "with read_only=True")
        self._settle()
        if self._rank == 0:
            with _signals.deferred():
                check(lib.ckpt_store_adopt(self._store.handle, step))

    @property
    def latest(self):
        """The step LATEST names (as this handle last saw it), or None."""
        if self._store is None:
            raise CkptError(Code.FAILED_PRECONDITION, "the checkpointer is closed")
        has, step = ctypes.c_int(), ctypes.c_uint64()
        check(lib.ckpt_store_latest(self._store.handle, ctypes.byref(has), ctypes.byref(step)))
        return step.value if has.value else None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        """Leaving a `with` block: an async save still in flight is finalized (collective) when
        the block ended normally, and abandoned (nothing published) when it raised, as a
        transaction commits or rolls back; then close(). A failed finalize raises after the
        close. One critical section: a Ctrl-C meanwhile comes after the close (and one that
        lands while the section is being set up still finds the checkpointer closed)."""
        try:
            with _signals.deferred():
                try:
                    if exc_type is None and self._pending is not None:
                        self._pending.finalize()
                finally:
                    self.close()
        finally:
            self.close()  # Harmless when closed; not, after a Ctrl-C in deferred()'s setup.
        return False

    def close(self):
        """Closes the checkpointer and its store (an async save in flight is abandoned: nothing
        published). Closing twice is harmless; without close(), both are closed when the last
        reference goes."""
        with _signals.deferred():
            self._pending = None
            for native in (self._native, self._store):
                if native is not None:
                    native.close()
