"""ckpt.integrations.lightning with the real Lightning (lightning_ckpt_worker.py's fit: a
LightningModule whose configure_optimizers returns StagedAdamW with amsgrad and a scheduler,
ModelCheckpoint every 2 steps keeping the newest 3): the optimizer's state goes to a ckpt store
through async saves while Lightning writes the rest of each checkpoint file; a resume ends bit
for bit where an uninterrupted fit ends, also after a SIGKILL during an async save;
ModelCheckpoint's rotation and ckpt's retention agree.

Needs the current stack (the virtual environment); skipped under Debian's torch."""
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lightning")
import ckpt  # noqa: E402
import lightning_ckpt_worker as worker  # noqa: E402
from ckpt.integrations.lightning import last_complete_checkpoint  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lightning_ckpt_worker.py")


def store_steps(root):
    return sorted(int(n[len("step-"):]) for n in os.listdir(root) if n.startswith("step-"))


def files(dirpath):
    return sorted(n for n in os.listdir(dirpath) if n.endswith(".ckpt"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    base = tmp_path_factory.mktemp("uninterrupted")
    weights, masters, keeper = worker.fit(base / "ckpts", base / "root")
    keeper.keeper.close()
    return weights, masters, base


def test_files_hold_a_reference_and_retention_follows_the_rotation(uninterrupted):
    _, _, base = uninterrupted
    dirpath, root = base / "ckpts", base / "root"
    assert files(dirpath) == ["epoch=0-step=4.ckpt", "epoch=1-step=6.ckpt", "epoch=1-step=8.ckpt"]
    assert store_steps(root) == [4, 6, 8], "ckpt keeps the steps the files name, and no other"
    saved = torch.load(dirpath / "epoch=1-step=8.ckpt", weights_only=True)
    (state,) = saved["optimizer_states"]
    assert (state["ckpt"]["root"], state["ckpt"]["step"]) == (str(root), 8)
    assert "state" not in state, "the tensors live in the ckpt store"


def test_a_fit_resumed_from_an_older_file_ends_bit_for_bit(tmp_path, uninterrupted):
    want, want_masters, _ = uninterrupted
    # A fit to the end, then its step-4 file (an epoch's end: Lightning resumes a plain
    # DataLoader exactly there) resumed over the same store, whose LATEST (8) moves back to 4.
    dirpath, root = tmp_path / "ckpts", tmp_path / "root"
    _, _, keeper = worker.fit(dirpath, root)
    keeper.keeper.close()
    got, masters, keeper = worker.fit(tmp_path / "again", root,
                                      ckpt_path=str(dirpath / "epoch=0-step=4.ckpt"))
    keeper.keeper.close()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(masters, want_masters))
    assert os.listdir(root / "quarantine"), "the first fit's steps 6 and 8 are set aside, kept"


def test_a_fit_killed_during_an_async_save_resumes_from_the_last_complete_file(
        tmp_path, uninterrupted):
    want, _, _ = uninterrupted
    dirpath, root = tmp_path / "ckpts", tmp_path / "root"
    killed = subprocess.run([sys.executable, WORKER, str(dirpath), str(root), "--kill-at", "6"],
                            capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stdout + killed.stderr
    assert files(dirpath) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=1-step=6.ckpt"]
    assert store_steps(root) == [2, 4], "step 6 never committed"
    last = last_complete_checkpoint(str(dirpath))
    assert last == str(dirpath / "epoch=0-step=4.ckpt")
    resumed = subprocess.run([sys.executable, WORKER, str(dirpath), str(root), "--resume", last],
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    got = torch.load(dirpath / "final-weights.pt")
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # ModelCheckpoint names the new step-6 file "-v1" beside the killed run's; every step a
    # remaining file names is in the store, and no other.
    assert "epoch=1-step=8.ckpt" in files(dirpath)
    named = {torch.load(dirpath / f, weights_only=True)["optimizer_states"][0]["ckpt"]["step"]
             for f in files(dirpath)}
    assert store_steps(root) == sorted(named)


def test_an_incomplete_file_is_refused_naming_why(tmp_path):
    dirpath, root = tmp_path / "ckpts", tmp_path / "root"
    killed = subprocess.run([sys.executable, WORKER, str(dirpath), str(root), "--kill-at", "6"],
                            capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stdout + killed.stderr
    with pytest.raises(ckpt.CkptError, match="never committed"):
        worker.fit(tmp_path / "again", root, ckpt_path=str(dirpath / "epoch=1-step=6.ckpt"))


@pytest.mark.parametrize("top_k", [1, 2])
def test_save_last_files_name_the_steps_the_store_keeps(tmp_path, uninterrupted, top_k):
    # last.ckpt is a second file of the same step (no second save); save_top_k=1 saves
    # synchronously (the previous file goes right after the new one is written). Either way
    # the store keeps exactly the steps the remaining files name.
    want, _, _ = uninterrupted
    dirpath, root = tmp_path / "ckpts", tmp_path / "root"
    got, _, keeper = worker.fit(dirpath, root, save_last=True, top_k=top_k)
    keeper.keeper.close()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert "last.ckpt" in files(dirpath)
    named = {torch.load(dirpath / f, weights_only=True)["optimizer_states"][0]["ckpt"]["step"]
             for f in files(dirpath)}
    assert store_steps(root) == sorted(named) == ([8] if top_k == 1 else [6, 8])
