"""What every trainer integration shares: a StagedAdamW whose state_dict() is a reference to a
step of a ckpt store, the saves of those steps (async, finalized when their writer is done), the
resolution of a reference by load_state_dict(), and retention by the steps a trainer's own
checkpoints still name."""
import ctypes
import os

from .. import _lib
from .._lib import CkptError
from ..checkpointer import Checkpointer


def _rank():
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


def step_committed(root, step):
    """Whether `step` is a committed step of the ckpt store at `root` (read without a lock):
    at or below LATEST, and its directory there."""
    if not isinstance(root, str) or not isinstance(step, int) or not os.path.isdir(root):
        return False
    options = _lib.StoreOptions(ctypes.sizeof(_lib.StoreOptions), 0, 1, 0, 0, 0)
    handle = ctypes.c_void_p()
    if _lib.lib.ckpt_store_open_with(_lib.encode_path(root, "root"), ctypes.byref(options),
                                     ctypes.byref(handle)) != _lib.OK:
        return False
    try:
        has, latest = ctypes.c_int(), ctypes.c_uint64()
        _lib.check(_lib.lib.ckpt_store_latest(handle, ctypes.byref(has), ctypes.byref(latest)))
    finally:
        _lib.lib.ckpt_store_close(handle)
    return bool(has.value) and step <= latest.value and os.path.isdir(
        os.path.join(root, f"step-{step:08d}"))


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
        self._saved = None  # The step saved last (committed or in flight).
        # Names this keeper's references in this process: one handed back unchanged (accelerate
        # round-trips state_dict() through load_state_dict() to place it on the device) is the
        # state the optimizer holds, with nothing to load.
        self._token = os.urandom(8).hex()
        self.files = {}  # A trainer's checkpoint files and the step each names (Lightning).
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
        self.optimizer, self._current_step = optimizer, current_step
        # Whole state on every rank (no process_group): rank 0 alone writes; the others read.
        self._writes = optimizer._group_handle is not None or _rank() == 0
        optimizer._layout["state_store"] = self

    # --- The optimizer's side (StagedAdamW.state_dict / load_state_dict) ---------------------

    def state_dict_reference(self, optimizer):
        return {"ckpt": {"root": self.root, "step": int(self._current_step()),
                         "token": self._token},
                "param_groups": optimizer._indexed_groups()}

    def load_reference(self, optimizer, state_dict):
        ref = state_dict["ckpt"]
        step = ref.get("step")
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"a ckpt reference names step {step!r}, not a step number")
        if ref.get("token") == self._token and step == self._current_step():
            return  # Our own reference of the state as it is (no step since): nothing to load.
        saved_in = ref.get("root")
        if isinstance(saved_in, str) and os.path.isdir(saved_in) and \
                os.path.realpath(saved_in) != os.path.realpath(self.root):
            raise ValueError(f"the checkpoint refers to step {step} of the ckpt store {saved_in}, "
                             f"and this integration keeps {self.root}: give it the store the "
                             "checkpoint was saved in (a store moved elsewhere is taken where "
                             "it is given)")
        ck = self.checkpointer()
        if not self.committed(step):
            raise CkptError(5, f"step {step} of the ckpt store {self.root} was never committed "
                               "(the run stopped during its async save): resume from the "
                               "integration's last_complete_checkpoint(...), the newest "
                               "checkpoint whose optimizer step is")
        ck.load(step)
        self._saved = step
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
        latest = self.checkpointer().latest
        return latest is not None and step <= latest and os.path.isdir(
            os.path.join(self.root, f"step-{step:08d}"))

    def save(self, step, keep=None, sync=False):
        """Collective on a sharded optimizer. Finalizes the save in flight, retires the
        committed steps not in `keep` (None: none), and begins the save of `step` (async unless
        async_save=False or `sync`); nothing when `step` is the one saved last."""
        if not self._writes or step == self._saved:
            return
        ck = self.checkpointer()
        if ck.pending is not None:
            ck.pending.finalize()
        if keep is not None:
            ck.keep_only(set(keep) | {step})
        if self.async_save and not sync:
            ck.save_async(step)
        else:
            ck.save(step)
        self._saved = step

    def writes(self):
        """This rank saves (every rank of a sharded optimizer; rank 0 otherwise)."""
        return self._writes

    def idle(self):
        """This rank writes and no save is in flight."""
        return self._writes and (self._checkpointer is None or self._checkpointer.pending is None)

    def keep_only(self, steps):
        """Retires the committed steps not in `steps` (see Checkpointer.keep_only). REQUIRES:
        idle() (then no collective is needed: only rank 0 removes)."""
        if self._checkpointer is not None:
            self._checkpointer.keep_only(steps)

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
