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
   steps this callback saved or saw a folder of that no checkpoint-* folder names any more are
   retired (save_total_limit's rotation and ckpt's retention agree: no folder names a retired
   step; a step another output_dir's folders name is not this run's); the save of step N
   begins.
3. The save commits at a later on_step_end once its writer is done, at the next on_save, or at
   on_train_end. Until then checkpoint-N is incomplete: a run killed meanwhile leaves a folder
   whose step N is not committed in the store.
4. Resume: last_complete_checkpoint(output_dir) names the newest folder whose trainer state is
   written and whose optimizer step is committed; Trainer loads it, and its
   optimizer.load_state_dict(reference) loads step N through ckpt.Checkpointer (the masters
   and moments exactly; the parameters become the masters rounded), and only the save the
   reference names (its save_id): a step saved again since by another run is refused by name.
   When step N is older than
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

from ._store import StoreKeeper, references_committed

# ASCII digits only: int() would refuse some of what \d matches ("checkpoint-³").
_FOLDER = re.compile(r"^" + transformers.trainer_utils.PREFIX_CHECKPOINT_DIR + r"-([0-9]+)$")
_TRAINER_STATE = "trainer_state.json"
_OPTIMIZER = "optimizer.pt"


def _folders(output_dir):
    """(global step, path) of each checkpoint-N folder of `output_dir` ("checkpoint-0008"
    included, as Trainer finds it), newest first."""
    found = []
    for name in os.listdir(output_dir) if os.path.isdir(output_dir) else ():
        m = _FOLDER.match(name)
        if m and os.path.isdir(os.path.join(output_dir, name)):
            found.append((int(m.group(1)), os.path.join(output_dir, name)))
    return sorted(found, reverse=True)


def _folder_steps(output_dir):
    """The global steps of the checkpoint-N folders of `output_dir`."""
    return [step for step, _ in _folders(output_dir)]


class CkptCallback(transformers.TrainerCallback):
    """Keeps `optimizer` (a ckpt.torch.StagedAdamW given to Trainer's `optimizers`) in the ckpt
    store at `root` (created if missing), one ckpt step per Trainer checkpoint, numbered by the
    global step. async_save=False saves synchronously at each checkpoint instead.
    checkpointer_options go to ckpt.Checkpointer (e.g. async_staging_bytes).

    While attached, the optimizer's state_dict() is a reference to a ckpt step, which only
    this callback saves and resolves: use it with the Trainer it is given to."""

    def __init__(self, optimizer, root, *, async_save=True, **checkpointer_options):
        self.optimizer = optimizer
        self._step = 0
        self.keeper = StoreKeeper(root, async_save=async_save, **checkpointer_options)
        self.keeper.attach(optimizer, lambda: self._step)

    @property
    def root(self):
        return self.keeper.root

    def on_train_begin(self, args, state, control, **kwargs):
        self._step = state.global_step
        self.keeper.known_steps |= set(_folder_steps(args.output_dir))
        if args.save_total_limit == 1:
            # Trainer removes the previous folder before on_save can begin (let alone commit)
            # the optimizer's save: for that while, no folder could be resumed.
            raise ValueError("CkptCallback needs save_total_limit of 2 or more (or None): with 1, "
                             "Trainer deletes the last complete checkpoint before the new one's "
                             "optimizer state is committed")
        if state.global_step == 0 and self.keeper.writes() and \
                self.keeper.checkpointer().latest is not None:
            raise ValueError(f"the ckpt store {self.root} already holds steps (LATEST "
                             f"{self.keeper.checkpointer().latest}) and this run starts from "
                             "step 0: give it a store of its own, or resume")

    def on_step_end(self, args, state, control, **kwargs):
        self._step = state.global_step
        if control.should_save:
            # Trainer saves the model's weights next: after the step's writes of them
            # (overlap="forward" leaves those to the next forward otherwise).
            self.optimizer.wait_for_step()
            # Trainer rotates the folders before on_save: the previous step must be committed
            # by then, so that a complete folder survives the rotation.
            self.keeper.finalize()
        else:
            self.keeper.finalize_if_written()

    def on_save(self, args, state, control, **kwargs):
        if args.save_only_model:
            return  # Trainer writes no optimizer.pt: nothing refers to a step.
        self._step = state.global_step
        # The steps the checkpoint folders name after Trainer's rotation (this one's included):
        # every other step this callback saved or saw a folder of goes (a step of another
        # output_dir sharing the store is not this run's to judge).
        folders = _folder_steps(args.output_dir)
        self.keeper.known_steps |= set(folders)
        self.keeper.save(state.global_step, referenced=folders,
                         retirable=self.keeper.saved_steps() | self.keeper.known_steps)

    def on_epoch_end(self, args, state, control, **kwargs):
        if control.should_save:  # save_strategy="epoch" decides here, after on_step_end.
            self.keeper.finalize()

    def on_evaluate(self, args, state, control, **kwargs):
        # save_strategy="best" decides after evaluating: the previous save must be committed
        # before a save (and its rotation) may follow.
        self.keeper.finalize()

    def on_train_end(self, args, state, control, **kwargs):
        self.keeper.finalize()

    def close(self):
        """Finalizes a save in flight, closes the Checkpointer and detaches from the optimizer
        (whose state_dict() is torch's format again)."""
        self.keeper.close()


def last_complete_checkpoint(output_dir):
    """The newest checkpoint-N folder of `output_dir` that a resume can use (or None): its
    trainer_state.json is written, and when its optimizer.pt refers to a ckpt step, that step
    is committed in its store and holds the save the reference names. What to pass to
    trainer.train(resume_from_checkpoint=...) after a run that may have been killed during a
    save."""
    import torch
    for _, folder in _folders(output_dir):
        optimizer = os.path.join(folder, _OPTIMIZER)
        if not os.path.isfile(os.path.join(folder, _TRAINER_STATE)) or \
                not os.path.isfile(optimizer):
            continue
        try:
            saved = torch.load(optimizer, map_location="cpu", weights_only=True)
        except Exception:  # A torn file: this folder is not complete.
            continue
        if references_committed([saved]):
            return folder
    return None
