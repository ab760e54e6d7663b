"""Accelerate's save_state / load_state with a ckpt.torch.StagedAdamW whose state is kept in a
ckpt store.

    from ckpt.integrations.accelerate import attach, last_complete_checkpoint
    accelerator = Accelerator(project_config=ProjectConfiguration(
        project_dir="run1", automatic_checkpoint_naming=True, total_limit=3))
    model, opt = accelerator.prepare(model, ckpt.torch.StagedAdamW(model.parameters(), lr=3e-4))
    keeper = attach(accelerator, opt, "/ckpts/run1-optimizer")
    accelerator.load_state(last_complete_checkpoint("run1/checkpoints"))   # when resuming
    ...
    accelerator.save_state()          # every N steps
    keeper.close()                    # at the end: commits the save in flight

Accelerate writes each state folder as usual (model weights as safetensors, scheduler,
samplers, RNG, custom objects); its optimizer.bin is a reference of a few hundred bytes to a
step of the ckpt store: the optimizer's step count when the folder was saved. The state
(FP32 masters, moments, step counts) is saved there as one transaction, asynchronously.

The protocol, for save_state() at optimizer step N:
1. Accelerate rotates its folders (automatic naming: beyond total_limit the oldest go), makes
   the new folder and calls its save-state pre-hooks before writing anything into it.
2. The pre-hook (every rank): the previous async save is finalized (committed or raised); the
   ckpt steps that no remaining folder's optimizer.bin names are retired (the rotation and
   ckpt's retention agree); the save of step N begins (synchronous when total_limit is 1: the
   only other folder is already gone, so the new one must be complete when save_state returns).
3. Accelerate writes the folder: optimizer.bin is the reference to step N; the RNG states are
   its last files.
4. The save commits after a later optimizer step once its writer is done (a step post-hook),
   at the next save_state, or at keeper.finalize() / keeper.close(). Until then the folder is
   incomplete: a run killed meanwhile leaves a folder whose step N is not committed.
5. Resume: last_complete_checkpoint(dir) names the newest folder whose RNG state (and custom
   objects' files, when told how many) is written and whose optimizer step is committed; load_state(folder) loads optimizer.bin, whose reference
   loads step N through ckpt.Checkpointer (exactly; an older step than LATEST is adopted so the
   run's next saves are accepted).

Data parallel: as the other integrations (ckpt/integrations/_store.py): with a process_group
every rank saves its pieces; without one rank 0 saves and the others read.
"""
import os
import re

import torch

from ._store import StoreKeeper, references_committed

__all__ = ["attach", "last_complete_checkpoint", "AccelerateKeeper"]

_FOLDER = re.compile(r"checkpoint_(\d+)")
_OPTIMIZERS = re.compile(r"optimizer(_\d+)?\.bin")
# What save_accelerator_state writes last (rank 0); custom objects come after it.
_RNG_FILE = "random_states_0.pkl"


def _optimizer_file(index):
    # Accelerate's names: optimizer.bin, optimizer_1.bin, ...
    return "optimizer.bin" if index == 0 else f"optimizer_{index}.bin"


def _folders(directory):
    """The checkpoint_<i> folders of `directory`, oldest first."""
    if directory is None or not os.path.isdir(directory):
        return []
    found = [(int(m.group(1)), os.path.join(directory, name)) for name in os.listdir(directory)
             if (m := _FOLDER.fullmatch(name)) and os.path.isdir(os.path.join(directory, name))]
    return [path for _, path in sorted(found)]


def _load(path):
    """A saved optimizer file's contents, or None (absent or torn)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # Absent or torn: it holds nothing.
        return None


def _reference_step(folder, index, root):
    """The step of the ckpt store at `root` that optimizer `index`'s file in `folder` refers
    to, or None (absent, torn, not a reference, or a reference to another store)."""
    saved = _load(os.path.join(folder, _optimizer_file(index)))
    ref = saved.get("ckpt") if isinstance(saved, dict) else None
    if not isinstance(ref, dict) or not isinstance(ref.get("root"), str):
        return None
    if os.path.realpath(ref["root"]) != os.path.realpath(root):
        return None
    step = ref.get("step")
    return step if isinstance(step, int) else None


def _optimizer_step(optimizer):
    return max(optimizer.param_steps(), default=0)


class AccelerateKeeper:
    """The ckpt side of one Accelerator's save_state/load_state for one StagedAdamW (made by
    attach). finalize() commits the save in flight; close() also detaches (the optimizer's
    state_dict() is torch's format again)."""

    def __init__(self, accelerator, optimizer, root, *, async_save=True,
                 **checkpointer_options):
        opt = getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer.
        self.accelerator = accelerator
        self.keeper = StoreKeeper(root, async_save=async_save, **checkpointer_options)
        self.keeper.attach(opt, lambda: _optimizer_step(opt))
        self.optimizer = opt
        # Which of the accelerator's optimizers this is: its file is optimizer_<index>.bin.
        self.index = next((i for i, o in enumerate(accelerator._optimizers)
                           if getattr(o, "optimizer", o) is opt), None)
        if self.index is None:
            self.keeper.close()
            raise ValueError("attach the optimizer accelerator.prepare() returned (or its "
                             "StagedAdamW): this one is not among the accelerator's optimizers")
        self._handles = [
            accelerator.register_save_state_pre_hook(self._before_save),
            opt.register_step_post_hook(lambda *_: self.keeper.finalize_if_written()),
        ]

    @property
    def root(self):
        return self.keeper.root

    def _rotation(self, output_dir):
        """The folder directory accelerate rotates (automatic naming), or None."""
        config = self.accelerator.project_configuration
        if not config.automatic_checkpoint_naming:
            return None
        return os.path.dirname(os.path.abspath(output_dir))

    def _before_save(self, models, weights, output_dir):
        # The models' weights are read next: after the step's writes of them (overlap="forward"
        # leaves those to the next forward otherwise).
        self.optimizer.wait_for_step()
        # Step 2.
        step = _optimizer_step(self.optimizer)
        directory = self._rotation(output_dir)
        referenced = None
        if directory is not None:
            referenced = set()
            for folder in _folders(directory):
                named = _reference_step(folder, self.index, self.keeper.root)
                if named is not None:
                    referenced.add(named)
                    self.keeper.note_file(folder, named)
        retirable = self.keeper.saved_steps() | self.keeper.known_steps
        limit = self.accelerator.project_configuration.total_limit
        self.keeper.save(step, referenced=referenced, retirable=retirable,
                         sync=directory is not None and limit == 1)

    def finalize(self):
        """Commits the save in flight (collective on a sharded optimizer); raises its error."""
        self.keeper.finalize()

    def close(self):
        """Finalizes, then detaches from the accelerator and the optimizer."""
        try:
            self.keeper.close()
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles = []


def attach(accelerator, optimizer, root, *, async_save=True, **checkpointer_options):
    """Keeps `optimizer`'s (a StagedAdamW, or accelerate's wrapper of one) state in the ckpt
    store at `root` through `accelerator`'s save_state / load_state. Call it before load_state.
    Returns the AccelerateKeeper (finalize() / close() at the end of training)."""
    return AccelerateKeeper(accelerator, optimizer, root, async_save=async_save,
                            **checkpointer_options)


def last_complete_checkpoint(directory, custom_objects=0):
    """The newest checkpoint_<i> folder of `directory` (accelerate's project_dir/checkpoints)
    that a resume can use, or None: its RNG state is written (and the files of the first
    `custom_objects` objects registered with register_for_checkpointing, which accelerate
    writes after it), and every optimizer file that refers to a ckpt step names a committed
    one."""
    for folder in reversed(_folders(directory)):
        wanted = [_RNG_FILE] + [f"custom_checkpoint_{i}.pkl" for i in range(custom_objects)]
        if not all(os.path.isfile(os.path.join(folder, name)) and
                   os.path.getsize(os.path.join(folder, name)) > 0 for name in wanted):
            continue
        files = [name for name in os.listdir(folder) if _OPTIMIZERS.fullmatch(name)]
        saved = [_load(os.path.join(folder, name)) for name in files]
        if files and all(s is not None for s in saved) and references_committed(saved):
            return folder
    return None
