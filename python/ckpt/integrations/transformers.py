"""HF transformers' Trainer with a ckpt.torch.StagedAdamW whose state is kept in a ckpt store.

    from ckpt.integrations.transformers import CkptCallback, last_complete_checkpoint
    opt = ckpt.torch.StagedAdamW(model.named_parameters(), lr=3e-4, weight_decay=0.1)
    trainer = Trainer(model=model, args=args, optimizers=(opt, scheduler),
                      callbacks=[CkptCallback(opt, "/ckpts/run1-optimizer")])
    trainer.train(resume_from_checkpoint=last_complete_checkpoint(args.output_dir))

Trainer writes each checkpoint folder (checkpoint-N: model, scheduler, RNG, trainer state) as
usual; its optimizer.pt is a reference of a few hundred bytes to step N of the ckpt store,
where the callback saves the optimizer's state (FP32 masters, moments, step counts) as one
transaction: asynchronously (the save overlaps the next training steps) and committed at the
next step that finds the writer done, at the next checkpoint, or at the end of training.

The protocol, for a checkpoint at global step N (numbered steps, as the code runs them):
1. Trainer writes checkpoint-N/ (model, then optimizer.pt: the reference to step N, scheduler,
   RNG, trainer_state.json), then rotates folders beyond save_total_limit.
2. on_save (every rank): the previous async save is finalized (committed or raised); the ckpt
   steps that no checkpoint-* folder names any more are retired (save_total_limit's rotation
   and ckpt's retention agree: no folder names a retired step, no committed step is orphaned);
   the save of step N begins.
3. The save commits at a later on_step_end once its writer is done, at the next on_save, or at
   on_train_end. Until then checkpoint-N is incomplete: a run killed meanwhile leaves a folder
   whose step N is not committed in the store.
4. Resume: last_complete_checkpoint(output_dir) names the newest folder whose trainer state is
   written and whose optimizer step is committed; Trainer loads it, and its
   optimizer.load_state_dict(reference) loads step N through ckpt.Checkpointer (the masters
   and moments exactly; the parameters become the masters rounded). When step N is older than
   the store's LATEST (a run resumed from an older folder), LATEST is moved back to N (adopt)
   so that the run's next saves are accepted; the newer steps stay on disk (set aside into
   quarantine/ when their numbers are saved again), never deleted.

Data parallel: with a process_group the optimizer is sharded and every rank saves its pieces
(on_save runs on every rank; Trainer's own state_dict() call on rank 0 only returns the
reference, no collective). Without one (each rank holds the whole state, DDP), rank 0 saves and
the other ranks load through read-only handles.
"""
import os
import re

import transformers

from ..checkpointer import Checkpointer
from .._lib import CkptError

_FOLDER = re.compile(r"^" + transformers.trainer_utils.PREFIX_CHECKPOINT_DIR + r"-(\d+)$")
_TRAINER_STATE = "trainer_state.json"
_OPTIMIZER = "optimizer.pt"


def _rank_and_world():
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class CkptCallback(transformers.TrainerCallback):
    """Keeps `optimizer` (a ckpt.torch.StagedAdamW given to Trainer's `optimizers`) in the ckpt
    store at `root` (created if missing), one ckpt step per Trainer checkpoint, numbered by the
    global step. async_save=False saves synchronously at each checkpoint instead.
    checkpointer_options go to ckpt.Checkpointer (e.g. async_staging_bytes).

    While attached, the optimizer's state_dict() is a reference to a ckpt step, which only
    this callback saves and resolves: use it with the Trainer it is given to."""

    def __init__(self, optimizer, root, *, async_save=True, **checkpointer_options):
        if not hasattr(optimizer, "_layout"):
            raise TypeError("CkptCallback keeps a ckpt.torch.StagedAdamW's state; got "
                            f"{type(optimizer).__name__}")
        if optimizer._layout.get("state_store") is not None:
            raise ValueError("the optimizer already has a ckpt integration attached")
        self.optimizer = optimizer
        self.root = os.path.abspath(os.fspath(root))
        self.async_save = async_save
        self._options = checkpointer_options
        self._checkpointer = None
        self._global_step = 0
        # Names this callback's references in this process: one handed back unchanged (accelerate
        # round-trips state_dict() through load_state_dict() to place it on the device) is the
        # state the optimizer holds, with nothing to load.
        self._token = os.urandom(8).hex()
        rank, world = _rank_and_world()
        # Whole state on every rank (no process_group): rank 0 alone writes.
        self._writes = optimizer._group_handle is not None or rank == 0
        self._world = world
        optimizer._layout["state_store"] = self

    # --- The optimizer's side (StagedAdamW.state_dict / load_state_dict) ---------------------

    def state_dict_reference(self, optimizer):
        """What optimizer.state_dict() returns while attached: the ckpt step the callback saves
        for this checkpoint, and the hyper-parameters (as torch's param_groups)."""
        return {"ckpt": {"root": self.root, "step": int(self._global_step), "token": self._token},
                "param_groups": optimizer._indexed_groups()}

    def load_reference(self, optimizer, state_dict):
        """optimizer.load_state_dict(reference): the step it names, loaded exactly."""
        step = state_dict["ckpt"].get("step")
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"a ckpt reference names step {step!r}, not a step number")
        if state_dict["ckpt"].get("token") == self._token and step == self._global_step:
            return  # Our own reference of the state as it is (no step since): nothing to load.
        ck = self._open()
        if not self._committed(step):
            raise CkptError(5, f"step {step} of the ckpt store {self.root} was never committed "
                               "(the run stopped during its async save): resume from "
                               "ckpt.integrations.transformers.last_complete_checkpoint("
                               "output_dir), the newest folder whose optimizer step is")
        ck.load(step)
        self._global_step = step
        if self._writes and not ck.read_only and ck.latest is not None and step < ck.latest:
            ck.adopt(step)  # The run goes on from here: its next saves must be accepted.

    # --- Trainer's side -------------------------------------------------------------------

    def on_train_begin(self, args, state, control, **kwargs):
        self._global_step = state.global_step

    def on_step_end(self, args, state, control, **kwargs):
        self._global_step = state.global_step
        ck = self._checkpointer
        if ck is not None and ck.pending is not None and ck.pending.writer_done:
            ck.pending.finalize()  # Cheap now: the writer is done; commits the step.

    def on_save(self, args, state, control, **kwargs):
        if args.save_only_model:
            return  # Trainer writes no optimizer.pt: nothing refers to a step.
        step = state.global_step
        self._global_step = step
        if not self._writes:
            return
        ck = self._open()
        if ck.pending is not None:
            ck.pending.finalize()
        # The steps the checkpoint folders name after Trainer's rotation (this one's included,
        # committed below): every other committed step goes.
        ck.keep_only(self._folder_steps(args.output_dir))
        if self.async_save:
            ck.save_async(step)
        else:
            ck.save(step)

    def on_train_end(self, args, state, control, **kwargs):
        ck = self._checkpointer
        if ck is not None and ck.pending is not None:
            ck.pending.finalize()

    # --- Helpers --------------------------------------------------------------------------

    def _open(self):
        """The Checkpointer, made on first use (read-only on the ranks that do not write)."""
        if self._checkpointer is None:
            if self._writes:
                os.makedirs(self.root, exist_ok=True)
                self._checkpointer = Checkpointer(self.root, self.optimizer, **self._options)
            else:
                self._checkpointer = Checkpointer(self.root, self.optimizer, read_only=True)
        return self._checkpointer

    def _committed(self, step):
        latest = self._open().latest
        return latest is not None and step <= latest and os.path.isdir(
            os.path.join(self.root, f"step-{step:08d}"))

    @staticmethod
    def _folder_steps(output_dir):
        steps = []
        for name in os.listdir(output_dir) if os.path.isdir(output_dir) else ():
            m = _FOLDER.match(name)
            if m and os.path.isdir(os.path.join(output_dir, name)):
                steps.append(int(m.group(1)))
        return steps

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
            if self.optimizer._layout.get("state_store") is self:
                del self.optimizer._layout["state_store"]


def last_complete_checkpoint(output_dir):
    """The newest checkpoint-N folder of `output_dir` that a resume can use (or None): its
    trainer_state.json is written, and when its optimizer.pt refers to a ckpt step, that step
    is committed in its store. What to pass to trainer.train(resume_from_checkpoint=...) after
    a run that may have been killed during a save."""
    import torch
    if not os.path.isdir(output_dir):
        return None
    found = []
    for name in os.listdir(output_dir):
        m = _FOLDER.match(name)
        if m and os.path.isdir(os.path.join(output_dir, name)):
            found.append((int(m.group(1)), os.path.join(output_dir, name)))
    for _, folder in sorted(found, reverse=True):
        if not os.path.isfile(os.path.join(folder, _TRAINER_STATE)):
            continue
        optimizer = os.path.join(folder, _OPTIMIZER)
        if not os.path.isfile(optimizer):
            continue
        try:
            saved = torch.load(optimizer, map_location="cpu", weights_only=True)
        except Exception:  # A torn file: this folder is not complete.
            continue
        ref = saved.get("ckpt") if isinstance(saved, dict) else None
        if ref is None or _step_committed(ref.get("root"), ref.get("step")):
            return folder
    return None


def _step_committed(root, step):
    """Whether `step` is a committed step of the ckpt store at `root` (read without a lock)."""
    from .. import _lib
    if not isinstance(root, str) or not isinstance(step, int) or not os.path.isdir(root):
        return False
    import ctypes
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
