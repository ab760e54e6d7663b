"""A Lightning fit whose StagedAdamW is kept in a ckpt store by ckpt.integrations.lightning:
what test_integration_lightning.py runs in its own process and in a child it kills. Usage:
    lightning_ckpt_worker.py DIRPATH ROOT [--kill-at N] [--resume PATH]
--kill-at N: SIGKILL this process when the batch after global step N starts while the async
save of step N is still in flight (before it commits). Dumps the final parameters."""
import argparse
import os
import signal
import sys

import torch

try:
    import lightning as L
except ImportError:
    import pytorch_lightning as L  # noqa: N812

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckpt.torch  # noqa: E402
from ckpt.integrations.lightning import CkptCallback  # noqa: E402

MAX_STEPS = 8
# CKPT_TEST_DEVICE=cuda (GPU host): Lightning on the GPU, StagedAdamW's CUDA engine.
ACCELERATOR = "gpu" if os.environ.get("CKPT_TEST_DEVICE") == "cuda" else "cpu"


def data():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                                       torch.nn.Linear(16, 1))

    def training_step(self, batch, index):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = ckpt.torch.StagedAdamW(self.parameters(), lr=1e-2, amsgrad=True)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, 3, gamma=0.5)]


class KillAt(L.Callback):
    def __init__(self, step, keeper):
        self.step, self.keeper = step, keeper

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            assert self.keeper.checkpointer().pending is not None
            os.kill(os.getpid(), signal.SIGKILL)


class Capture(L.Callback):
    """The parameters and masters as training ends (before Lightning's teardown, which comes
    before on_fit_end, moves a GPU module back to the CPU, where the optimizer would refuse to
    read it)."""

    def on_train_end(self, trainer, pl_module):
        opt = trainer.optimizers[0]
        self.weights = [p.detach().cpu().clone() for p in pl_module.parameters()]
        self.masters = [opt.master(p) for p in opt._params]


def fit(dirpath, root, ckpt_path=None, kill_at=None, save_last=False, top_k=3):
    """Fits to MAX_STEPS with a checkpoint every 2 steps (the newest 3 kept); returns the
    parameters and masters as fitting ended, and the callback."""
    module = Module()
    if ckpt_path is not None:
        with torch.no_grad():  # Weights the resume must replace.
            for p in module.parameters():
                p.mul_(0.5)
    keeper = CkptCallback(root)
    saver = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=str(dirpath), every_n_train_steps=2, save_top_k=top_k, monitor="step", mode="max",
        save_last=save_last)
    capture = Capture()
    callbacks = [saver, keeper, capture] + ([KillAt(kill_at, keeper.keeper)] if kill_at else [])
    trainer = L.Trainer(max_steps=MAX_STEPS, accelerator=ACCELERATOR, devices=1, logger=False,
                        callbacks=callbacks, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(dirpath))
    trainer.fit(module, data(), ckpt_path=ckpt_path)
    return capture.weights, capture.masters, keeper


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("dirpath")
    parser.add_argument("root")
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--resume")
    a = parser.parse_args()
    weights, _, keeper = fit(a.dirpath, a.root, a.resume, a.kill_at)
    keeper.keeper.close()
    torch.save(weights, os.path.join(a.dirpath, "final-weights.pt"))
