"""Runs of the Accelerate integration tests (test_integration_accelerate.py), in process or as a
subprocess that is SIGKILLed right after a save_state whose async optimizer save is in flight.
Usage: accelerate_ckpt_worker.py PROJECT_DIR ROOT KIND STEPS KILL_AT"""
import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckpt.torch  # noqa: E402
from ckpt.integrations.accelerate import attach  # noqa: E402


# CKPT_TEST_DEVICE=cuda (GPU host): accelerate on the GPU, StagedAdamW's CUDA engine.
DEVICE = os.environ.get("CKPT_TEST_DEVICE", "cpu")


def make_model(kind):
    torch.manual_seed(0)
    if kind == "mlp":
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                                   torch.nn.Linear(16, 1))
    import peft
    import transformers
    from test_trainer_generic import llama_path
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_path(), dtype=torch.bfloat16)
    return peft.get_peft_model(model, peft.LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights="gaussian"))


def loss(model, kind, step):
    g = torch.Generator().manual_seed(step)
    if kind == "mlp":
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
        return torch.nn.functional.mse_loss(model(x.to(DEVICE)), y.to(DEVICE))
    ids = torch.randint(0, 100, (2, 12), generator=g).to(DEVICE)
    return model(input_ids=ids, labels=ids).loss


def run(project_dir, root, kind, steps, save_every=2, total_limit=2, resume=None,
        kill_at=None):
    """Trains optimizer steps resume+1..steps (1..steps from scratch), save_state every
    `save_every` steps; returns the trainable parameters and the keeper (closed)."""
    import accelerate
    from accelerate.utils import ProjectConfiguration
    acc = accelerate.Accelerator(cpu=DEVICE == "cpu", project_config=ProjectConfiguration(
        project_dir=str(project_dir), automatic_checkpoint_naming=True, total_limit=total_limit))
    model = make_model(kind).to(DEVICE)  # Before the optimizer: it keeps them where they are.
    if resume is not None:
        with torch.no_grad():  # Weights the resume must replace.
            for p in model.parameters():
                p.mul_(0.5)
    params = [p for p in model.parameters() if p.requires_grad]
    model, opt = acc.prepare(model, ckpt.torch.StagedAdamW(params, lr=1e-2, weight_decay=0.1))
    keeper = attach(acc, opt, root)
    try:
        first = 1
        if resume is not None:
            acc.load_state(resume)
            first = max(opt.optimizer.param_steps()) + 1
        for step in range(first, steps + 1):
            opt.zero_grad()
            acc.backward(loss(model, kind, step))
            opt.step()
            if save_every and step % save_every == 0:
                acc.save_state()
                if kill_at == step:
                    os.kill(os.getpid(), signal.SIGKILL)
    finally:
        keeper.close()  # Commits the save in flight; lets go of the store's LOCK.
    return [p.detach().clone() for p in model.parameters() if p.requires_grad], keeper


if __name__ == "__main__":
    project_dir, root, kind, steps, kill_at = sys.argv[1:6]
    run(project_dir, root, kind, int(steps), kill_at=int(kill_at))
