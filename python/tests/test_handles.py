"""One owner for every native handle (ckpt/_native.py): wrappers that share the optimizer's
__dict__, garbage collection in any order, closing twice and interpreter exit with a save in
flight never crash; copies and pickles refuse with a clear message.

The scenarios that used to crash run in a child process, so that a segmentation fault is a
failed test and not a dead test runner."""
import copy
import gc
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

import ckpt
import ckpt.torch

PYTHON_DIR = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def run_child(body, *args):
    """Runs `body` (Python source, with ckpt, ckpt.torch, torch and gc imported) in a fresh
    interpreter; returns the CompletedProcess."""
    script = "import gc, sys, torch, ckpt, ckpt.torch\n" + textwrap.dedent(body)
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=300)


def small():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    return model, ckpt.torch.StagedAdamW(model.named_parameters(), lr=1e-2)


def step(model, opt, seed=0):
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(3, 8, generator=g)).pow(2).sum().backward()
    opt.step()


def wrap_as_lightning_does(optimizer):
    """What Lightning's LightningOptimizer does to an optimizer: an object whose __dict__ is a
    copy of the optimizer's and whose class derives from the optimizer's class."""

    class Wrapper:
        pass

    wrapper = Wrapper()
    wrapper.__dict__ = {k: v for k, v in optimizer.__dict__.items() if k not in ("step", "__del__")}
    wrapper.__class__ = type("Lightning" + optimizer.__class__.__name__,
                             (Wrapper, optimizer.__class__), {})
    return wrapper


def test_a_wrapper_sharing_the_dict_collected_while_the_optimizer_lives_on(tmp_path):
    model, opt = small()
    ck = ckpt.Checkpointer(tmp_path / "root", opt)
    wrapper = wrap_as_lightning_does(opt)
    step(model, wrapper)  # The wrapper steps the same native optimizer.
    del wrapper
    gc.collect()
    step(model, opt, seed=1)
    ck.save(2)
    assert ck.latest == 2
    assert opt.group_steps() == [2]


def test_lightning_optimizer_wrapper_collected_while_the_optimizer_lives_on(tmp_path):
    lightning = pytest.importorskip("lightning.pytorch.core.optimizer")
    model, opt = small()
    wrapper = lightning.LightningOptimizer(opt)
    assert isinstance(wrapper, ckpt.torch.StagedAdamW)
    del wrapper
    gc.collect()
    step(model, opt)
    assert opt.group_steps() == [1]


@pytest.mark.parametrize("order", ["optimizer-first", "checkpointer-first", "pending-first",
                                   "all-at-once"])
def test_garbage_collection_in_any_order_never_crashes(tmp_path, order):
    child = run_child("""
        order, root = sys.argv[1], sys.argv[2]
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 64)
        opt = ckpt.torch.StagedAdamW(model.named_parameters(), lr=1e-2)
        ck = ckpt.Checkpointer(root, opt)
        model(torch.randn(2, 64)).sum().backward()
        opt.step()
        ck.save(1)
        pending = ck.save_async(2)
        names = {"optimizer-first": ["opt", "ck", "pending"],
                 "checkpointer-first": ["ck", "opt", "pending"],
                 "pending-first": ["pending", "ck", "opt"],
                 "all-at-once": []}[order]
        for name in names:
            del globals()[name]
            gc.collect()
        if order == "all-at-once":
            del opt, ck, pending
            gc.collect()
        print("survived")
    """, order, tmp_path / "root")
    assert child.returncode == 0, child.stdout + child.stderr
    assert "survived" in child.stdout
    # The abandoned save published nothing: LATEST is step 1, and it loads.
    model, opt = small()
    model = torch.nn.Linear(64, 64)
    opt = ckpt.torch.StagedAdamW(model.named_parameters(), lr=1e-2)
    ck = ckpt.Checkpointer(tmp_path / "root", opt)
    assert ck.latest == 1
    ck.load()
    ck.close()


def test_interpreter_exit_with_a_save_in_flight(tmp_path):
    child = run_child("""
        root = sys.argv[1]
        torch.manual_seed(0)
        model = torch.nn.Linear(256, 256)
        opt = ckpt.torch.StagedAdamW(model.named_parameters(), lr=1e-2)
        ck = ckpt.Checkpointer(root, opt)
        model(torch.randn(2, 256)).sum().backward()
        opt.step()
        ck.save(1)
        ck.save_async(2)
        print("exiting")
    """, tmp_path / "root")
    assert child.returncode == 0, child.stdout + child.stderr
    assert "exiting" in child.stdout
    model = torch.nn.Linear(256, 256)
    opt = ckpt.torch.StagedAdamW(model.named_parameters(), lr=1e-2)
    ck = ckpt.Checkpointer(tmp_path / "root", opt)
    assert ck.latest == 1
    ck.load()
    assert opt.group_steps() == [1]
    ck.close()


def test_closing_twice_is_harmless_and_use_after_close_raises(tmp_path):
    model, opt = small()
    ck = ckpt.Checkpointer(tmp_path / "root", opt)
    pending = ck.save_async(1)
    ck.close()
    ck.close()
    with pytest.raises(ckpt.CkptError, match="closed"):
        pending.finalize()
    opt.close()
    opt.close()
    with pytest.raises(ckpt.CkptError, match="closed"):
        step(model, opt)
    # The closed store let go of the root: another checkpointer opens it.
    model2, opt2 = small()
    ckpt.Checkpointer(tmp_path / "root", opt2).close()


def test_copies_and_pickles_refuse_with_a_clear_message(tmp_path):
    model, opt = small()
    with pytest.raises(TypeError, match="deep-copied"):
        copy.deepcopy(opt)
    with pytest.raises(TypeError, match="pickled"):
        pickle.dumps(opt)
    with pytest.raises(TypeError, match="pickled"):
        copy.copy(opt)
    ck = ckpt.Checkpointer(tmp_path / "root", opt)
    with pytest.raises(TypeError, match="cannot be"):
        copy.deepcopy(ck)
    with pytest.raises(TypeError, match="cannot be"):
        pickle.dumps(ck)
    # The refusals changed nothing.
    step(model, opt)
    ck.save(1)
    ck.close()


def test_a_dropped_checkpointer_lets_go_of_the_root_and_of_its_save(tmp_path):
    model, opt = small()
    step(model, opt)
    ck = ckpt.Checkpointer(tmp_path / "root", opt)
    ck.save(1)
    ck.save_async(2)  # Abandoned with its checkpointer: nothing published.
    del ck
    gc.collect()
    # The root's LOCK went with it, and so did the async save's fence on the optimizer.
    ck2 = ckpt.Checkpointer(tmp_path / "root", opt)
    assert ck2.latest == 1
    opt.load_state_dict(opt.state_dict())
    step(model, opt, seed=1)
    ck2.save(3)
    ck2.close()


def test_the_state_view_follows_a_checkpointer_load(tmp_path):
    model, opt = small()
    step(model, opt)
    ck = ckpt.Checkpointer(tmp_path / "root", opt)
    ck.save(1)
    saved = {k: v.clone() for k, v in opt.state[next(model.parameters())].items()}
    step(model, opt, seed=1)
    moved = opt.state_dict()["state"][0]["exp_avg"]  # Cached after the second step.
    assert not torch.equal(moved, saved["exp_avg"])
    ck.load(1)
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], saved["exp_avg"])
    assert torch.equal(opt.state[next(model.parameters())]["master"], saved["master"])
    ck.close()
