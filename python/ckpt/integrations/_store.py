"""What every trainer integration shares: a StagedAdamW whose state_dict() is a reference to a
save in a ckpt store, the saves themselves (async, finalized when their writer is done), the
resolution of a reference by load_state_dict(), and retention by the steps a trainer's own
checkpoints still name.

A reference is {"root", "step", "save_id"}: the save's identity (ckpt.Checkpointer's save_id,
recorded in the step) makes it name one save, whatever runs share the store. Resolving it:
1. Its root must be a str naming this keeper's store (or a store since moved, taken where the
   keeper is given it); its step a count.
2. A reference this keeper handed out for its next save (of the same step), handed back with
   the state unchanged since (accelerate round-trips state_dict() through load_state_dict()
   before anything is saved) loads nothing: there is no save yet, and the state is the one it
   describes; its hyper-parameters are taken, as torch's load_state_dict takes them.
3. Otherwise the step must be committed and hold that save (its save_id blob): else NOT_FOUND
   naming both (a later run saved the same step number again; the save named was set aside
   into quarantine/, never loaded in its place). A reference without save_id (an older ckpt's)
   names the step alone.
4. It is loaded, also when the state already equals it (the Checkpointer's state_id): ckpt then
   reads nothing into the state, and the parameters and hyper-parameters are put back from it
   (edits through .data or of param_groups are not seen as changes of the state). A step older
   than LATEST is adopted, so the run's next saves are accepted.
Retention: a keeper retires only steps it saved or that a trainer file it saw named.
"""
import ctypes
import os

from .. import _lib
from .._lib import CkptError, Code
from ..checkpointer import Checkpointer, agreed_session, step_save_id



def _rank():
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


def _is_count(step):
    return isinstance(step, int) and not isinstance(step, bool) and 0 <= step < 2 ** 64


def store_steps(handle):
    """The steps with a directory in an open store (the library names step directories)."""
    count = ctypes.c_size_t()
    _lib.check(_lib.lib.ckpt_store_steps(handle, None, 0, ctypes.byref(count)))
    while True:
        steps = (ctypes.c_uint64 * max(1, count.value))()
        capacity = count.value
        _lib.check(_lib.lib.ckpt_store_steps(handle, steps, capacity, ctypes.byref(count)))
        if count.value <= capacity:
            return [int(s) for s in steps[:count.value]]


def step_committed(root, step, save_id=None):
    """Whether `step` is a committed step of the ckpt store at `root` (read without a lock):
    at or below LATEST, its directory there, and (save_id given) holding that save."""
    if not isinstance(root, str) or not _is_count(step) or not os.path.isdir(root):
        return False
    options = _lib.StoreOptions(ctypes.sizeof(_lib.StoreOptions), 0, 1, 0, 0, 0)
    handle = ctypes.c_void_p()
    if _lib.lib.ckpt_store_open_with(_lib.encode_path(root, "root"), ctypes.byref(options),
                                     ctypes.byref(handle)) != _lib.OK:
        return False
    try:
        has, latest = ctypes.c_int(), ctypes.c_uint64()
        _lib.check(_lib.lib.ckpt_store_latest(handle, ctypes.byref(has), ctypes.byref(latest)))
        if not has.value or step > latest.value or step not in store_steps(handle):
            return False
        if save_id is None:
            return True
        try:
            return step_save_id(handle, step) == save_id
        except CkptError:  # Damaged or gone: it holds no save that could be loaded.
            return False
    finally:
        _lib.lib.ckpt_store_close(handle)


def references_committed(states):
    """Whether every ckpt reference among the optimizer state dicts `states` (as a trainer's
    checkpoint holds them) names a committed step holding the save it names: a checkpoint
    without one is complete as far as ckpt is concerned."""
    for state in states:
        ref = state.get("ckpt") if isinstance(state, dict) else None
        if isinstance(ref, dict) and not step_committed(ref.get("root"), ref.get("step"),
                                                        ref.get("save_id")):
            return False
    return True


class StoreKeeper:
    """The ckpt store at `root` (created if missing) holding one optimizer's state, one step per
    trainer checkpoint. Attached to the optimizer, it is what the optimizer's state_dict()
    returns (a reference) and resolves (load_state_dict of a reference)."""

    def __init__(self, root, *, async_save=True, **checkpointer_options):
        for key in ("keep_last", "keep_every", "read_only", "process_group"):
            if key in checkpointer_options:
                raise ValueError(f"{key} is the integration's to decide (retention follows the "
                                 "trainer's own checkpoints)")
        self.root = os.path.abspath(os.fspath(root))
        self.async_save = async_save
        self._options = checkpointer_options
        self.optimizer = None
        self._current_step = lambda: 0
        self._checkpointer = None
        self._saved = None  # The step saved last (committed or in flight), or loaded.
        self._saved_id = None  # That save's identity.
        self._mine = set()  # The steps this keeper saved.
        self.loaded = None  # The step a reference was last loaded from (a resume's source).
        # Save identities: "<session>-<count>", the session agreed by the optimizer's ranks.
        self._session, self._count = None, 0
        # The references handed out for the next save (its identity -> its step and the
        # optimizer's generation then): one handed back unchanged is the state it describes.
        self._handed = {}
        self.files = {}  # A trainer's checkpoint files and the step each names (Lightning).
        self.known_steps = set()  # Every step a file seen so far named.
        self.dropped = False  # A file was removed since the last save.
        self._writes = True

    def attach(self, optimizer, current_step):
        """Makes `optimizer`'s state_dict() a reference to the step `current_step()` names."""
        if not hasattr(optimizer, "_layout"):
            raise TypeError("ckpt's integrations keep a ckpt.torch.StagedAdamW's state; got "
                            f"{type(optimizer).__name__}")
        other = optimizer._layout.get("state_store")
        if other is not None and other is not self:
            raise ValueError("the optimizer already has a ckpt integration attached")
        if self.optimizer is not None and self.optimizer is not optimizer:
            # Another fit with a new optimizer: the Checkpointer and the references were the
            # old one's.
            self.finalize()
            if self._checkpointer is not None:
                self._checkpointer.close()
                self._checkpointer = None
            if self.optimizer._layout.get("state_store") is self:
                del self.optimizer._layout["state_store"]
            self._saved = self._saved_id = None
            self._handed = {}
        self.optimizer, self._current_step = optimizer, current_step
        # Collective with a sharded optimizer (every rank attaches): the ranks name saves alike.
        self._session = agreed_session(optimizer._group_handle)
        # Whole state on every rank (no process_group): rank 0 alone writes; the others read.
        self._writes = optimizer._group_handle is not None or _rank() == 0
        optimizer._layout["state_store"] = self

    # --- The optimizer's side (StagedAdamW.state_dict / load_state_dict) ---------------------

    def _next_id(self, step):
        # The step is part of the identity: one handed out for step N never names the save of
        # another step.
        return f"{self._session}-{step:x}-{self._count:x}"

    def state_dict_reference(self, optimizer):
        step = int(self._current_step())
        if step == self._saved and self._saved_id is not None:
            save_id = self._saved_id  # Saved (or loaded) already: save() will not save again.
        else:
            save_id = self._next_id(step)
            self._handed[save_id] = (step, optimizer._generation())
        return {"ckpt": {"root": self.root, "step": step, "save_id": save_id},
                "param_groups": optimizer._indexed_groups()}

    def _check_reference(self, ref):
        """Step 1: what the reference holds, refused by name before anything else."""
        step, save_id, saved_in = ref.get("step"), ref.get("save_id"), ref.get("root")
        if not _is_count(step):
            raise ValueError(f"a ckpt reference names step {step!r}, not a step number")
        if not isinstance(saved_in, str):
            raise ValueError(f"a ckpt reference's root is {saved_in!r}, not a str path: it was "
                             "not written by ckpt")
        if save_id is not None and not isinstance(save_id, str):
            raise ValueError(f"a ckpt reference's save_id is {save_id!r}, not a str")
        if os.path.isdir(saved_in) and \
                os.path.realpath(saved_in) != os.path.realpath(self.root):
            raise ValueError(f"the checkpoint refers to step {step} of the ckpt store "
                             f"{saved_in}, and this integration keeps {self.root}: give it "
                             "the store the checkpoint was saved in (a store moved "
                             "elsewhere is taken where it is given)")

    def _check_committed(self, step):
        if not self.committed(step):
            raise CkptError(Code.NOT_FOUND, f"step {step} of the ckpt store {self.root} was "
                            "never committed (the run stopped during its async save): resume "
                            "from the integration's last_complete_checkpoint(...), the newest "
                            "checkpoint whose optimizer step is")

    def load_reference(self, optimizer, state_dict):
        ref = state_dict["ckpt"]
        sharded = optimizer._group_handle is not None
        error, pending = None, False
        try:
            self._check_reference(ref)
            step, save_id = ref["step"], ref.get("save_id")
            # Step 2.
            pending = save_id is not None and \
                self._handed.get(save_id) == (step, optimizer._generation())
            if not pending:
                self._check_committed(step)
        except Exception as e:  # Every rank refuses if any does (the load is collective).
            error = e
        if sharded:
            if optimizer._any_rank(error is not None) and error is None:
                error = ValueError("another rank refused the ckpt reference; nothing was loaded")
            pending = error is None and not optimizer._any_rank(not pending)
        if error is not None:
            raise error
        if pending:
            optimizer._take_hyper_parameters(state_dict.get("param_groups"))
            return
        # Steps 3 (the save's identity, checked by the load itself) and 4.
        ck = self.checkpointer()
        ck.load(step, save_id=save_id)
        self.loaded = step
        self._saved, self._saved_id = step, ck.loaded_save_id
        if self._writes and ck.latest is not None and step < ck.latest:
            ck.adopt(step)  # The run goes on from here: its next saves must be accepted.

    # --- Saves ------------------------------------------------------------------------------

    def checkpointer(self):
        """The Checkpointer, made on first use (read-only on the ranks that do not write)."""
        if self._checkpointer is None:
            if self._writes:
                os.makedirs(self.root, exist_ok=True)
                self._checkpointer = Checkpointer(self.root, self.optimizer, **self._options)
            else:
                self._checkpointer = Checkpointer(self.root, self.optimizer, read_only=True)
        return self._checkpointer

    def committed(self, step):
        ck = self.checkpointer()
        latest = ck.latest
        return latest is not None and step <= latest and step in store_steps(ck._store.handle)

    def note_file(self, path, step):
        """A checkpoint file of the trainer's, and the step it names."""
        self.files[path] = step
        self.known_steps.add(step)

    def saved_steps(self):
        """The steps this keeper saved in this process."""
        return set(self._mine)

    @property
    def saved_step(self):
        """The step saved last (committed or in flight), or None."""
        return self._saved

    def save(self, step, referenced=None, retirable=None, sync=False):
        """Collective on a sharded optimizer. Finalizes the save in flight, retires what
        retire_unreferenced(referenced, retirable) does (referenced None: nothing), and begins
        the save of `step` (async unless async_save=False or `sync`); nothing when `step` is the
        one saved last."""
        if not self._writes or step == self._saved:
            return
        ck = self.checkpointer()
        if ck.pending is not None:
            ck.pending.finalize()
        if referenced is not None:
            self.retire_unreferenced(referenced, retirable)
        save_id = self._next_id(step)
        if self.async_save and not sync:
            ck.save_async(step, save_id=save_id)
        else:
            ck.save(step, save_id=save_id)
        self._count += 1
        self._handed.pop(save_id, None)
        self._saved, self._saved_id = step, save_id
        self._mine.add(step)

    def retire_unreferenced(self, referenced, retirable=None):
        """Retires the committed steps of `retirable` (None: every committed step) that neither
        `referenced` (the steps the trainer's checkpoints name) nor the resume's source names
        (unless a checkpoint the trainer integration has seen named it: then it goes with that
        checkpoint, like any other). REQUIRES: no save in flight."""
        ck = self._checkpointer
        if ck is None:
            return
        latest = ck.latest
        committed = {s for s in store_steps(ck._store.handle)
                     if latest is not None and s <= latest}
        keep = set(referenced)
        if self.loaded is not None and self.loaded not in self.known_steps:
            keep.add(self.loaded)  # Resumed from a checkpoint elsewhere: not ours to judge.
        doomed = (committed if retirable is None else committed & set(retirable)) - keep
        if doomed:
            ck.keep_only(committed - doomed)

    def writes(self):
        """This rank saves (every rank of a sharded optimizer; rank 0 otherwise)."""
        return self._writes

    def idle(self):
        """This rank writes and no save is in flight."""
        return self._writes and (self._checkpointer is None or self._checkpointer.pending is None)

    def finalize_if_written(self):
        """Commits the save in flight if its writer is done (cheap then). With a sharded
        optimizer the ranks agree first (finalize is collective; each rank's writer finishes
        at its own time)."""
        ck = self._checkpointer
        if ck is None or ck.pending is None:
            return
        done = ck.pending.writer_done
        if self.optimizer._group_handle is not None:
            done = not self.optimizer._any_rank(not done)
        if done:
            ck.pending.finalize()

    def finalize(self):
        ck = self._checkpointer
        if ck is not None and ck.pending is not None:
            ck.pending.finalize()

    def close(self):
        """Finalizes a save in flight, closes the Checkpointer and detaches from the optimizer
        (whose state_dict() is torch's format again)."""
        ck, self._checkpointer = self._checkpointer, None
        try:
            if ck is not None and ck.pending is not None:
                ck.pending.finalize()
        finally:
            if ck is not None:
                ck.close()
            if self.optimizer is not None and \
                    self.optimizer._layout.get("state_store") is self:
                del self.optimizer._layout["state_store"]
