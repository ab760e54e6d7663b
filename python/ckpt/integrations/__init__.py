"""ckpt inside the trainers people use. Each submodule imports its library only when it is
imported itself:

- ckpt.integrations.transformers: HF Trainer (CkptCallback, last_complete_checkpoint).
- ckpt.integrations.lightning: Lightning (CkptCallback, last_complete_checkpoint).

docs/integrations.md says, for each, the lines a user adds, what is saved where, and how a
resume finds it."""
