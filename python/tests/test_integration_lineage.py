"""Lineage, in every trainer integration alike (HF Trainer, Accelerate, Lightning): run A saves
steps 2, 4, 6 (and 8) with its folders in A; run B resumes A's step-4 folder into a new folder B
with the same ckpt store, and saves the same step numbers again. Then every folder of A resolves
to exactly A's state, or is refused by name (its step now holds B's save): B retired none of A's
steps, and last_complete_checkpoint(A) never names a folder whose step holds another save.
Needs the current stack (skipped under Debian's torch)."""
import os

import pytest
import torch

import ckpt
import ckpt.torch

pytest.importorskip("accelerate")
pytest.importorskip("lightning")


def state_of(opt):
    params = opt._params
    return ([opt.master(p) for p in params], [opt.exp_avg(p) for p in params],
            opt.param_steps())


def resolve(root, make_opt, ref):
    """What loading reference `ref` (as a resume does: the step, checked to hold the save the
    reference names) gives: the optimizer's state, or the CkptError refusing it."""
    opt = make_opt()
    ck = ckpt.Checkpointer(root, opt, read_only=True)
    try:
        ck.load(ref["step"], save_id=ref["save_id"])
        return state_of(opt)
    except ckpt.CkptError as e:
        return e
    finally:
        ck.close()
        opt.close()


def same(a, b):
    return a[2] == b[2] and all(torch.equal(x, y) for x, y in zip(a[0] + a[1], b[0] + b[1]))


def check_lineage(root, refs_before, refs_after, saved_again):
    """refs_*: {A's folder: its reference}, read before and after run B."""
    assert refs_before == refs_after, "run B changed A's folders"
    for folder, ref in refs_before.items():
        assert os.path.isdir(os.path.join(root, f"step-{ref['step']:08d}")), \
            f"run B removed step {ref['step']}, which A's {folder} names"
    return {folder: ref["step"] in saved_again for folder, ref in refs_before.items()}


def run_lineage(root, a_refs, run_b, make_opt, saved_again):
    """Reads A's states, runs B, then checks each of A's folders resolves to its state or is
    refused by name (the steps `saved_again` by B)."""
    want = {folder: resolve(root, make_opt, ref) for folder, ref in a_refs().items()}
    assert all(not isinstance(s, Exception) for s in want.values()), want
    before = a_refs()
    run_b()
    after = a_refs()
    refused = check_lineage(root, before, after, saved_again)
    for folder, ref in after.items():
        got = resolve(root, make_opt, ref)
        if refused[folder]:
            assert isinstance(got, ckpt.CkptError) and got.code == "NOT_FOUND", (folder, got)
            assert f"step {ref['step']} holds save" in str(got), str(got)
        else:
            assert not isinstance(got, Exception), (folder, got)
            assert same(got, want[folder]), f"{folder} resolves to another state"
    return refused


# --- HF Trainer ---------------------------------------------------------------------------------

def test_hf_a_run_resumed_into_a_new_folder_keeps_the_old_folders_lineage(tmp_path):
    import hf_ckpt_worker as worker
    import transformers
    from ckpt.integrations.transformers import last_complete_checkpoint
    a, b, root = tmp_path / "A", tmp_path / "B", str(tmp_path / "store")
    _, _, keeper = worker.run(a, root, limit=3)
    keeper.close()

    def a_refs():
        return {f: torch.load(a / f / "optimizer.pt", weights_only=True)["ckpt"]
                for f in sorted(os.listdir(a)) if f.startswith("checkpoint-")}
    assert sorted(a_refs()) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]

    def make_opt():
        model = transformers.AutoModelForCausalLM.from_pretrained(worker.LLAMA,
                                                                   dtype=torch.bfloat16)
        return ckpt.torch.StagedAdamW(model.named_parameters(), lr=1e-3, weight_decay=0.1)

    def run_b():
        _, _, kb = worker.run(b, root, halve=True, resume_from=str(a / "checkpoint-4"),
                              limit=3)
        kb.close()
    refused = run_lineage(root, a_refs, run_b, make_opt, saved_again={6})
    assert refused == {"checkpoint-2": False, "checkpoint-4": False, "checkpoint-6": True}
    assert last_complete_checkpoint(str(a)) == str(a / "checkpoint-4")
    # Through the integration too (a resume of A's checkpoint-6): refused by name, nothing
    # loaded.
    opt = make_opt()
    from ckpt.integrations.transformers import CkptCallback
    keeper = CkptCallback(opt, root)
    before = state_of(opt)
    with pytest.raises(ckpt.CkptError, match="step 6 holds save"):
        opt.load_state_dict(torch.load(a / "checkpoint-6" / "optimizer.pt", weights_only=True))
    assert same(state_of(opt), before)
    keeper.close()


# --- Accelerate ---------------------------------------------------------------------------------

def test_accelerate_a_run_resumed_into_a_new_project_keeps_the_old_folders_lineage(tmp_path):
    from accelerate_ckpt_worker import make_model, run
    from ckpt.integrations.accelerate import last_complete_checkpoint
    a, b, root = tmp_path / "A", tmp_path / "B", str(tmp_path / "store")
    run(a, root, "mlp", 8, total_limit=4)
    folders = a / "checkpoints"

    def a_refs():
        return {f: torch.load(folders / f / "optimizer.bin", weights_only=True)["ckpt"]
                for f in sorted(os.listdir(folders))}
    assert [r["step"] for r in a_refs().values()] == [2, 4, 6, 8]

    def make_opt():
        params = [p for p in make_model("mlp").parameters() if p.requires_grad]
        return ckpt.torch.StagedAdamW(params, lr=1e-2, weight_decay=0.1)

    def run_b():
        run(b, root, "mlp", 8, total_limit=4, resume=str(folders / "checkpoint_1"))
    refused = run_lineage(root, a_refs, run_b, make_opt, saved_again={6, 8})
    assert refused == {"checkpoint_0": False, "checkpoint_1": False, "checkpoint_2": True,
                       "checkpoint_3": True}
    assert last_complete_checkpoint(str(folders)) == str(folders / "checkpoint_1")


# --- Lightning ----------------------------------------------------------------------------------

def test_lightning_a_fit_resumed_into_a_new_dirpath_keeps_the_old_files_lineage(tmp_path):
    import lightning_ckpt_worker as worker
    from ckpt.integrations.lightning import last_complete_checkpoint
    a, b, root = tmp_path / "A", tmp_path / "B", str(tmp_path / "store")
    _, _, keeper = worker.fit(a, root, top_k=-1)
    keeper.keeper.close()

    def a_refs():
        out = {}
        for f in sorted(os.listdir(a)):
            if f.endswith(".ckpt"):
                saved = torch.load(a / f, weights_only=True)
                out[f] = saved["optimizer_states"][0]["ckpt"]
        return out
    by_step = {r["step"]: f for f, r in a_refs().items()}
    assert sorted(by_step) == [2, 4, 6, 8]

    def make_opt():
        return worker.Module().configure_optimizers()[0][0]

    def run_b():
        _, _, kb = worker.fit(b, root, ckpt_path=str(a / by_step[4]), top_k=-1)
        kb.keeper.close()
    refused = run_lineage(root, a_refs, run_b, make_opt, saved_again={6, 8})
    assert {by_step[s]: refused[by_step[s]] for s in by_step} == \
        {by_step[2]: False, by_step[4]: False, by_step[6]: True, by_step[8]: True}
    assert last_complete_checkpoint(str(a)) == str(a / by_step[4])
