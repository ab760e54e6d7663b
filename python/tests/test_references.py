"""Save identities and the references trainer integrations write (ckpt/integrations/_store.py):
a Checkpointer's state_id holds only while the state provably equals that save; a reference
handed back loads nothing only then (a retry after an exception between optimizer.step() and
the trainer's counter, or a second fit with a cached optimizer, loads); references of any root
type are checked; stray names in a store and malformed trainer files are skipped; and
load_state_dict checks state shapes and requires "step" as torch does."""
import os

import pytest
import torch

import ckpt
import ckpt.torch
from ckpt.integrations._store import StoreKeeper, references_committed


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))


def train(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(3, 4, generator=g)).pow(2).sum().backward()
    opt.step()


def masters(opt):
    return [opt.master(p) for p in opt._params]


def test_state_id_holds_only_while_the_state_equals_that_save(tmp_path):
    model = net()
    opt = ckpt.torch.StagedAdamW(model.parameters(), lr=1e-2)
    with ckpt.Checkpointer(tmp_path / "root", opt) as ck:
        assert ck.state_id is None
        train(model, opt, 0)
        first = ck.save(1)
        assert ck.state_id == first == ck.save_id_of(1)
        train(model, opt, 1)
        assert ck.state_id is None, "a step since"
        pending = ck.save_async(2)
        assert ck.state_id is None, "not committed yet"
        pending.finalize()
        assert ck.state_id == pending.save_id != first
        with torch.no_grad():
            model[0].weight.mul_(2)
        assert ck.state_id is None, "an edit of a parameter since"
        ck.load(1)
        assert ck.state_id == ck.loaded_save_id == first
        opt.load_state_dict(opt.state_dict())
        assert ck.state_id is None, "a load_state_dict since"


def test_a_load_by_save_id_loads_that_save_only(tmp_path):
    model = net()
    opt = ckpt.torch.StagedAdamW(model.parameters(), lr=1e-2)
    with ckpt.Checkpointer(tmp_path / "root", opt) as ck:
        train(model, opt, 0)
        old = ck.save(1)
        want = masters(opt)
        train(model, opt, 1)
        ck.save(2)
        ck.adopt(1)
        train(model, opt, 2)
        again = ck.save(2)  # Step 2 saved again: the first save of it goes to quarantine/.
        now = masters(opt)
        with pytest.raises(ckpt.CkptError, match="step 2 holds save .*, not save"):
            ck.load(2, save_id=old)
        assert all(torch.equal(a, b) for a, b in zip(masters(opt), now)), "nothing loaded"
        ck.load(1, save_id=old)
        assert all(torch.equal(a, b) for a, b in zip(masters(opt), want))
        ck.load(2, save_id=again)
        assert all(torch.equal(a, b) for a, b in zip(masters(opt), now))
        with pytest.raises(ValueError, match="save identity"):
            ck.load(2, save_id="not hex!")


class Counter:
    """A trainer's step counter, moved by the test as a trainer moves it."""

    def __init__(self):
        self.step = 0


def keeper_for(opt, root, counter, async_save=False):
    keeper = StoreKeeper(root, async_save=async_save)
    keeper.attach(opt, lambda: counter.step)
    return keeper


def test_a_reference_handed_back_after_the_state_moved_on_loads_its_save(tmp_path):
    model, counter = net(), Counter()
    opt = ckpt.torch.StagedAdamW(model.parameters(), lr=1e-2)
    keeper = keeper_for(opt, str(tmp_path / "root"), counter)
    train(model, opt, 0)
    counter.step = 1
    ref = opt.state_dict()  # What the trainer writes into its folder, then saves.
    keeper.save(1)
    want = masters(opt)
    # Handed back with nothing changed: the state stays the save's (ckpt reads nothing).
    opt.load_state_dict(ref)
    assert all(torch.equal(a, b) for a, b in zip(masters(opt), want))
    # An exception between optimizer.step() and the trainer's counter: the step counter still
    # says 1, the state moved on. The retry hands the folder's reference back: it loads.
    train(model, opt, 1)
    assert not all(torch.equal(a, b) for a, b in zip(masters(opt), want))
    opt.load_state_dict(ref)
    assert all(torch.equal(a, b) for a, b in zip(masters(opt), want))
    assert opt.param_steps() == [1] * len(opt._params)
    keeper.close()


def test_a_reference_for_the_next_save_handed_back_unchanged_loads_nothing(tmp_path):
    # accelerate's prepare round-trips state_dict() through load_state_dict() before any save.
    model, counter = net(), Counter()
    opt = ckpt.torch.StagedAdamW(model.parameters(), lr=1e-2)
    keeper = keeper_for(opt, str(tmp_path / "root"), counter)
    train(model, opt, 0)
    counter.step = 1
    opt.load_state_dict(opt.state_dict())  # Not saved yet, and unchanged: nothing loaded.
    ref = opt.state_dict()
    train(model, opt, 1)
    # Changed since: the save it names was never committed, so it is refused, not skipped.
    with pytest.raises(ckpt.CkptError, match="never committed"):
        opt.load_state_dict(ref)
    keeper.close()


@pytest.mark.parametrize("root", [b"/some/bytes/root", 7, None])
def test_a_reference_whose_root_is_no_str_is_refused_by_name(tmp_path, root):
    model, counter = net(), Counter()
    opt = ckpt.torch.StagedAdamW(model.parameters(), lr=1e-2)
    keeper = keeper_for(opt, str(tmp_path / "root"), counter)
    ref = opt.state_dict()
    ref["ckpt"] = dict(ref["ckpt"], root=root, save_id="0123-4")
    with pytest.raises(ValueError, match="root is .*, not a str path"):
        opt.load_state_dict(ref)
    keeper.close()


def test_stray_names_in_a_store_do_not_stop_retention(tmp_path):
    root = tmp_path / "root"
    model, counter = net(), Counter()
    opt = ckpt.torch.StagedAdamW(model.parameters(), lr=1e-2)
    keeper = keeper_for(opt, str(root), counter)
    for step in (1, 2, 3):
        train(model, opt, step)
        counter.step = step
        keeper.save(step, referenced=[step], retirable=keeper.saved_steps())
        if step == 1:
            # Names a user (or a tool) left: digits int() refuses, a non-step.
            (root / "step-\u00b3").mkdir()
            (root / "step-notes").write_text("x")
    # Step 1 retired (2 stays: the state's undo source when 3's save began); the strays stay.
    assert sorted(os.listdir(root)) == ["LATEST", "LOCK", "step-00000002", "step-00000003",
                                        "step-notes", "step-\u00b3"]
    keeper.close()


def test_malformed_references_are_not_complete(tmp_path):
    assert references_committed([{"ckpt": {"root": str(tmp_path), "step": True}}]) is False
    assert references_committed([{"ckpt": {"root": b"x", "step": 1}}]) is False
    assert references_committed([{"ckpt": {"root": str(tmp_path), "step": -1}}]) is False
    assert references_committed([{"state": {}}, "not a dict"]) is True


def test_lightning_skips_files_that_are_no_lightning_checkpoint(tmp_path):
    pytest.importorskip("lightning")
    from ckpt.integrations.lightning import last_complete_checkpoint
    torch.save({"global_step": 4, "optimizer_states": []}, tmp_path / "good.ckpt")
    torch.save([1, 2, 3], tmp_path / "a-list.ckpt")
    torch.save({"global_step": "nine", "optimizer_states": []}, tmp_path / "bad-step.ckpt")
    torch.save({"global_step": 9, "optimizer_states": 5}, tmp_path / "bad-states.ckpt")
    (tmp_path / "torn.ckpt").write_bytes(b"PK\x03")
    assert last_complete_checkpoint(str(tmp_path)) == str(tmp_path / "good.ckpt")


def test_hf_finds_a_complete_folder_named_with_leading_zeros(tmp_path):
    pytest.importorskip("transformers")
    from ckpt.integrations.transformers import last_complete_checkpoint
    folder = tmp_path / "checkpoint-0008"
    folder.mkdir()
    (folder / "trainer_state.json").write_text("{}")
    torch.save({"state": {}, "param_groups": []}, folder / "optimizer.pt")
    (tmp_path / "checkpoint-\u00b3").mkdir()  # Digits int() refuses: not a folder of Trainer's.
    assert last_complete_checkpoint(str(tmp_path)) == str(folder)


def test_load_state_dict_checks_shapes_and_requires_step_as_torch_does():
    model = net()
    opt = ckpt.torch.StagedAdamW(model.parameters(), lr=1e-2)
    train(model, opt, 0)
    good = opt.state_dict()
    before = masters(opt)
    wrong_shape = {**good, "state": {**good["state"]}}
    entry = dict(good["state"][0])
    entry["exp_avg"] = entry["exp_avg"].t().contiguous()  # 8x4 -> 4x8: the same count.
    wrong_shape["state"][0] = entry
    with pytest.raises(ValueError, match=r"exp_avg of parameter .* has shape \[4, 8\]"):
        opt.load_state_dict(wrong_shape)
    no_step = {**good, "state": {**good["state"]}}
    no_step["state"][1] = {k: v for k, v in good["state"][1].items() if k != "step"}
    with pytest.raises(KeyError, match="has no 'step'"):
        opt.load_state_dict(no_step)
    assert all(torch.equal(a, b) for a, b in zip(masters(opt), before)), "nothing changed"
    opt.load_state_dict(good)


def test_a_read_only_checkpointer_reloads_the_step_it_loaded(tmp_path):
    # The reload needs no undo source, the state equals the step: nothing to spill below the
    # root, which a read-only handle may not write (0963850 refused it).
    model = net()
    opt = ckpt.torch.StagedAdamW(model.parameters(), lr=1e-2)
    with ckpt.Checkpointer(tmp_path / "root", opt) as ck:
        train(model, opt, 0)
        saved = ck.save(1)
    fresh = net()
    opt = ckpt.torch.StagedAdamW(fresh.parameters(), lr=1e-2)
    with ckpt.Checkpointer(tmp_path / "root", opt, read_only=True) as ck:
        ck.load(1)  # Into a fresh optimizer: its undo is re-derived, nothing written.
        want = masters(opt)
        ck.load(1, save_id=saved)
        assert all(torch.equal(a, b) for a, b in zip(masters(opt), want))
        assert ck.state_id == saved
    assert not [n for n in os.listdir(tmp_path / "root") if n.startswith(".undo")]


def test_a_reference_to_the_state_as_it_is_still_puts_back_weights_and_hyper_parameters(
        tmp_path):
    # Edits through .data move no version counter, and param_groups are no state: a reference
    # handed back restores both from its save (found by a probe: the shortcut kept the edits).
    model, counter = net(), Counter()
    opt = ckpt.torch.StagedAdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    keeper = keeper_for(opt, str(tmp_path / "root"), counter)
    train(model, opt, 0)
    counter.step = 1
    ref = opt.state_dict()
    keeper.save(1)
    weights = [p.detach().clone() for p in model.parameters()]
    model[0].weight.data.mul_(0)
    opt.param_groups[0]["lr"], opt.param_groups[0]["weight_decay"] = 0.5, 0.3
    opt.load_state_dict(ref)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert (opt.param_groups[0]["lr"], opt.param_groups[0]["weight_decay"]) == (1e-2, 0.01)
    keeper.close()


def test_references_are_checked_before_anything_else(tmp_path):
    model, counter = net(), Counter()
    opt = ckpt.torch.StagedAdamW(model.parameters(), lr=1e-2)
    root = str(tmp_path / "root")
    keeper = keeper_for(opt, root, counter)
    train(model, opt, 0)
    counter.step = 5
    stale = opt.state_dict()  # Handed out for a save of step 5 that never happens.
    train(model, opt, 1)
    counter.step = 10
    keeper.save(10)
    current = opt.state_dict()["ckpt"]
    # The save of step 10 is not the one handed out for step 5: nothing of it is taken.
    with pytest.raises(ckpt.CkptError, match="step 5 .* never committed"):
        opt.load_state_dict(stale)
    forged = [({"root": "/no/such/store", "step": 999999}, ckpt.CkptError, "never committed"),
              ({"step": True}, ValueError, "not a step number"),
              ({"step": 10.0}, ValueError, "not a step number"),
              ({"step": -1}, ValueError, "not a step number"),
              ({"save_id": ["x"]}, ValueError, "save_id is"),
              ({"save_id": {}}, ValueError, "save_id is")]
    for change, error, match in forged:
        ref = {"ckpt": dict(current, **change), "param_groups": stale["param_groups"]}
        with pytest.raises(error, match=match):
            opt.load_state_dict(ref)
    keeper.close()
