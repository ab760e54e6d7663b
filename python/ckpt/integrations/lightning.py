"""Lightning with a ckpt.torch.StagedAdamW whose state is kept in a ckpt store.

    from ckpt.integrations.lightning import CkptCallback, last_complete_checkpoint
    trainer = L.Trainer(callbacks=[ModelCheckpoint(...), CkptCallback("/ckpts/run1-optimizer")])
    trainer.fit(module, ckpt_path=last_complete_checkpoint(dirpath))

The LightningModule's configure_optimizers returns the StagedAdamW as usual. Lightning writes
each checkpoint file (weights, loops, callbacks, schedulers) through its CheckpointIO as usual;
the file's "optimizer_states" hold a reference to ckpt step N (the global step) instead of the
optimizer's tensors, and the state itself is one ckpt transaction, saved asynchronously while
training goes on.

The protocol, for a checkpoint at global step N:
1. setup: the callback wraps the strategy's CheckpointIO (Lightning's storage seam; an
   AsyncCheckpointIO given as a plugin stays underneath), so it sees every checkpoint file
   written and removed. on_fit_start attaches it to the StagedAdamW (before Lightning restores
   a checkpoint's optimizer states, which then resolve through it).
2. Lightning's dump_checkpoint: the optimizer's state_dict() is the reference to step N; then
   on_save_checkpoint (every rank): the previous async save is finalized, the ckpt steps no
   remaining checkpoint file names are retired (ModelCheckpoint's save_top_k and ckpt's
   retention agree), and the save of step N begins (once per step: save_last's second file of
   the same step refers to the same ckpt step).
3. The CheckpointIO writes the file (rank 0) and records which step it names; removing a file
   (ModelCheckpoint's rotation) drops that reference.
4. The save commits at the first later batch whose writer is done, at the next checkpoint, or
   when fitting ends. A file whose step never committed (the run was killed) is incomplete:
   last_complete_checkpoint(dirpath) passes over it, and restoring it raises naming it.
"""
import os

import torch

try:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.io import CheckpointIO
except ImportError:  # The standalone package.
    import pytorch_lightning as pl
    from pytorch_lightning.plugins.io import CheckpointIO

from ._store import StoreKeeper, references_committed


class _CkptIO(CheckpointIO):
    """The strategy's CheckpointIO with the files' references to ckpt steps noted."""

    def __init__(self, keeper, base):
        super().__init__()
        self.keeper, self.base = keeper, base

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.base.save_checkpoint(checkpoint, path, storage_options=storage_options)
        step = _reference_step(checkpoint)
        if step is not None:
            self.keeper.note_file(os.path.abspath(os.fspath(path)), step)

    def load_checkpoint(self, path, *args, **kwargs):
        checkpoint = self.base.load_checkpoint(path, *args, **kwargs)
        step = _reference_step(checkpoint)
        if step is not None:
            self.keeper.note_file(os.path.abspath(os.fspath(path)), step)
        return checkpoint

    def remove_checkpoint(self, path):
        path = os.path.abspath(os.fspath(path))
        if path not in self.keeper.files and os.path.isfile(path):
            step = _file_step(path)  # A file of an earlier run: which step it named.
            if step is not None:
                self.keeper.note_file(path, step)
        self.base.remove_checkpoint(path)
        self.keeper.files.pop(path, None)
        self.keeper.dropped = True

    def teardown(self):
        self.base.teardown()


def _reference_step(checkpoint):
    """The ckpt step a checkpoint's optimizer state refers to, or None (none, or malformed)."""
    states = checkpoint.get("optimizer_states", ()) if isinstance(checkpoint, dict) else ()
    for state in states if isinstance(states, (list, tuple)) else ():
        if isinstance(state, dict) and isinstance(state.get("ckpt"), dict):
            step = state["ckpt"].get("step")
            return step if isinstance(step, int) and not isinstance(step, bool) else None
    return None


def _file_step(path):
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # A torn or foreign file: it names no step we can tell.
        return None
    return _reference_step(checkpoint)


class CkptCallback(pl.Callback):
    """Keeps the StagedAdamW of the LightningModule in the ckpt store at `root` (created if
    missing), one ckpt step per global step that Lightning checkpoints. async_save=False
    saves synchronously instead; checkpointer_options go to ckpt.Checkpointer."""

    def __init__(self, root, *, async_save=True, **checkpointer_options):
        super().__init__()
        self.keeper = StoreKeeper(root, async_save=async_save, **checkpointer_options)
        self._trainer = None

    def setup(self, trainer, pl_module, stage):
        if not isinstance(trainer.strategy.checkpoint_io, _CkptIO):
            trainer.strategy.checkpoint_io = _CkptIO(self.keeper, trainer.strategy.checkpoint_io)

    def on_fit_start(self, trainer, pl_module):
        self._trainer = trainer
        # The files of earlier runs name steps too: retention must keep those.
        for callback in trainer.checkpoint_callbacks:
            dirpath = getattr(callback, "dirpath", None)
            for path in _checkpoint_files(dirpath):
                if path not in self.keeper.files:
                    step = _file_step(path)
                    if step is not None:
                        self.keeper.note_file(path, step)
        staged = [o for o in trainer.optimizers if hasattr(o, "_layout")]
        if len(staged) != 1:
            raise ValueError(f"ckpt's Lightning CkptCallback keeps one ckpt.torch.StagedAdamW; "
                             f"configure_optimizers gave {len(staged)}")
        self.keeper.attach(staged[0], lambda: self._trainer.global_step)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if self.keeper.optimizer is not None:
            # The checkpoint's state_dict holds the parameters themselves, written out next:
            # after the step's writes of them (overlap="forward" leaves those to the next
            # forward otherwise).
            self.keeper.optimizer.wait_for_step()
        if self.keeper.optimizer is None or trainer.global_step == self.keeper.saved_step:
            return  # save_last's second file of the step names the same ckpt step.
        retire = self.keeper.dropped
        self.keeper.dropped = False
        # A ModelCheckpoint that keeps one file (or none) removes the previous file right after
        # writing this one, and trainer.save_checkpoint without one may overwrite the only file:
        # the step must be committed by then, so the save is synchronous.
        callbacks = trainer.checkpoint_callbacks
        sync = not callbacks or any(getattr(cb, "save_top_k", -1) in (0, 1) for cb in callbacks)
        self.keeper.save(trainer.global_step,
                         referenced=set(self.keeper.files.values()) if retire else None,
                         retirable=self._retirable(), sync=sync)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.keeper.finalize_if_written()
        self._retire()

    def on_fit_end(self, trainer, pl_module):
        self.keeper.finalize()
        self._retire()

    def teardown(self, trainer, pl_module, stage):
        self.keeper.finalize()

    def _retire(self):
        """ModelCheckpoint removes old files after writing the new one: once no save is in
        flight, the steps no file names any more go (rank 0, which writes the files, knows)."""
        if self.keeper.dropped and self.keeper.idle():
            self.keeper.dropped = False
            self.keeper.retire_unreferenced(set(self.keeper.files.values()), self._retirable())

    def _retirable(self):
        """The steps this callback may retire: those it saved, and those of files it has seen
        (a file elsewhere, of an earlier run in another directory, is not its to judge)."""
        return self.keeper.saved_steps() | self.keeper.known_steps


def _checkpoint_files(dirpath):
    if not dirpath or not os.path.isdir(dirpath):
        return []
    return [os.path.abspath(os.path.join(dirpath, n)) for n in sorted(os.listdir(dirpath))
            if n.endswith(".ckpt") and os.path.isfile(os.path.join(dirpath, n))]


def last_complete_checkpoint(dirpath):
    """The checkpoint file of `dirpath` with the highest global step whose optimizer step (when
    it refers to one) is committed and holds the save it names, or None (files that are no
    Lightning checkpoint are skipped): what to pass to fit(ckpt_path=...) after a run
    that may have been killed during a save."""
    best = None
    for path in _checkpoint_files(dirpath):
        try:
            checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception:  # A torn file is not complete.
            continue
        if not isinstance(checkpoint, dict):
            continue  # Not a Lightning checkpoint: skipped, as a torn one is.
        step, states = checkpoint.get("global_step", -1), checkpoint.get("optimizer_states", ())
        if not isinstance(step, int) or not isinstance(states, (list, tuple)) or \
                not references_committed(states):
            continue
        if best is None or step > best[0]:
            best = (step, path)
    return best[1] if best is not None else None
