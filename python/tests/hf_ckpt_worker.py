"""A HF Trainer run of the tiny transformers-written Llama (BF16, tied embeddings, gradient
accumulation) whose StagedAdamW is kept in a ckpt store by ckpt.integrations.transformers: what
test_integration_transformers.py runs in its own process and in a child it kills. Usage:
    hf_ckpt_worker.py OUTPUT_DIR ROOT [--stop-at N] [--kill-at N] [--resume | --resume-from DIR]
                      [--sharded]
--kill-at N: SIGKILL this process in on_save at step N, once the callback has begun the async
save of step N (before it commits). Launched by torchrun (RANK set), each process is a rank of a
DDP job over gloo; --sharded shards the optimizer over it (process_group). Prints nothing; the
test compares the weights it dumps (final-weights.pt, or final-weights-RANK.pt)."""
import argparse
import os
import signal
import sys

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckpt.torch  # noqa: E402
from ckpt.integrations.transformers import CkptCallback, last_complete_checkpoint  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The testdata beside the clone, or where CKPT_HF_TESTDATA says (the GPU host has a copy).
LLAMA = os.path.join(os.environ.get("CKPT_HF_TESTDATA") or
                     os.path.join(REPO, "..", "shared", "testdata", "hf_tiny_models"),
                     "llama-tied-tiny")
# CKPT_TEST_DEVICE=cuda (GPU host): the model on the GPU, StagedAdamW's CUDA engine.
DEVICE = os.environ.get("CKPT_TEST_DEVICE", "cpu")
MAX_STEPS = 6


class Tokens(torch.utils.data.Dataset):
    def __init__(self, vocab):
        self.vocab = vocab

    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(0, self.vocab, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


class StopAt(transformers.TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


class KillAt(transformers.TrainerCallback):
    """After CkptCallback's on_save (callbacks run in order): its async save is in flight."""

    def __init__(self, step, callback):
        self.step, self.callback = step, callback

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            assert self.callback.keeper.checkpointer().pending is not None
            os.kill(os.getpid(), signal.SIGKILL)


def run(out, root, stop_at=None, kill_at=None, resume=False, halve=False, resume_from=None,
        limit=2, process_group=None):
    """Trains to MAX_STEPS (or stop_at), checkpointing every 2 steps (2 folders kept); returns
    the parameters, the optimizer and the callback."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(LLAMA, dtype=torch.bfloat16)
    model.to(DEVICE)  # Before the optimizer: it keeps the parameters where they are.
    if halve:
        with torch.no_grad():  # Weights the resume must replace.
            for p in model.parameters():
                p.mul_(0.5)
    # With a process group (a DDP job), the state is sharded over the ranks; DDP has averaged
    # the gradients already.
    opt = ckpt.torch.StagedAdamW(model.named_parameters(), lr=1e-3, weight_decay=0.1,
                                 process_group=process_group, reduce_grads=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        max_steps=MAX_STEPS, save_steps=2, save_total_limit=limit, report_to=[],
        use_cpu=DEVICE == "cpu",
        seed=0, data_seed=0, disable_tqdm=True)
    keeper = CkptCallback(opt, root)
    callbacks = [keeper]
    if stop_at is not None:
        callbacks.append(StopAt(stop_at))
    if kill_at is not None:
        callbacks.append(KillAt(kill_at, keeper))
    trainer = transformers.Trainer(model=model, args=args, optimizers=(opt, sched),
                                   train_dataset=Tokens(model.config.vocab_size),
                                   callbacks=callbacks)
    if resume_from is None and resume:
        resume_from = last_complete_checkpoint(str(out))
    trainer.train(resume_from_checkpoint=resume_from)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, opt, keeper


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("root")
    parser.add_argument("--stop-at", type=int)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--resume-from")
    parser.add_argument("--sharded", action="store_true")
    a = parser.parse_args()
    group, name = None, "final-weights.pt"
    if "RANK" in os.environ:  # A rank of a torchrun job.
        import torch.distributed as dist
        dist.init_process_group("gloo")
        name = f"final-weights-{dist.get_rank()}.pt"
        if a.sharded:
            group = dist.group.WORLD
    resuming = a.resume or a.resume_from is not None
    weights, opt, keeper = run(a.out, a.root, a.stop_at, a.kill_at, a.resume, halve=resuming,
                               resume_from=a.resume_from, process_group=group)
    keeper.close()
    torch.save({n: t.cpu() for n, t in weights.items()}, os.path.join(a.out, name))
    opt.close()
    # As dp_worker.py: not the interpreter's own exit (pytorch/pytorch#179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
