"""ckpt.torch.StagedAdamW and ckpt.Checkpointer against torch, on the CPU engine."""
import json
import os
import struct

import pytest
import torch

import ckpt
import ckpt.torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TESTDATA = os.path.join(REPO, "..", "shared", "testdata", "hf_tiny_models")


class TinyGPT(torch.nn.Module):
    """A small GPT block: embedding, self-attention, MLP, layer norms, a head."""

    def __init__(self, vocab=97, dim=32, heads=4):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.norm1 = torch.nn.LayerNorm(dim)
        # No projection biases (as Llama): the key bias's true gradient is zero, and what
        # backward computes for it is rounding noise that no two runs share.
        self.attn = torch.nn.MultiheadAttention(dim, heads, bias=False, batch_first=True)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(),
                                       torch.nn.Linear(4 * dim, dim))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        n = ids.shape[1]
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool, device=ids.device), 1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        x = x + self.mlp(self.norm2(x))
        return self.head(x)


def groups(model):
    """Two param groups: weight decay on matrices, none on norms and biases."""
    decay = [(n, p) for n, p in model.named_parameters() if p.dim() >= 2]
    plain = [(n, p) for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}]


def muon_groups(model):
    """StagedMuon's usual split of TinyGPT: Muon for the attention and MLP matrices, AdamW for
    the embedding, head, norms and biases."""
    hidden = [(n, p) for n, p in model.named_parameters()
              if p.dim() == 2 and n.startswith(("attn.", "mlp."))]
    rest = [(n, p) for n, p in model.named_parameters()
            if not (p.dim() == 2 and n.startswith(("attn.", "mlp.")))]
    return [{"params": hidden}, {"params": rest, "use_muon": False}]


def torch_groups(model):
    return [{"params": [p for _, p in g["params"]], "weight_decay": g["weight_decay"]}
            for g in groups(model)]


def batch(step, vocab=97):
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, vocab, (4, 16), generator=g)
    return ids[:, :-1], ids[:, 1:]


def loss_of(model, step):
    x, y = batch(step)
    return torch.nn.functional.cross_entropy(model(x).reshape(-1, 97), y.reshape(-1))


def shard_loss(model, step, rank, world):
    """Rank `rank` of `world`'s part of step `step`'s loss: the mean over its shard of a batch of
    6 sequences (averaged over the ranks, the gradient of the whole batch's mean)."""
    g = torch.Generator().manual_seed(2000 + step)
    ids = torch.randint(0, 97, (6, 16), generator=g)
    shard = ids[rank * 6 // world:(rank + 1) * 6 // world].to(next(model.parameters()).device)
    x, y = shard[:, :-1], shard[:, 1:]
    return torch.nn.functional.cross_entropy(model(x).reshape(-1, 97), y.reshape(-1))


def schedule(step):
    return min(1.0, (step + 1) / 5) * (0.5 ** (step / 20))


def relative(a, b):
    return ((a.double() - b.double()).norm() / max(b.double().norm(), 1e-30)).item()


def test_parity_with_torch_adamw_fp32():
    torch.manual_seed(0)
    ours, ref = TinyGPT(), TinyGPT()
    ref.load_state_dict(ours.state_dict())
    opt = ckpt.torch.StagedAdamW(groups(ours), lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    ropt = torch.optim.AdamW(torch_groups(ref), lr=3e-3, betas=(0.9, 0.95), eps=1e-8,
                             foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    rsched = torch.optim.lr_scheduler.LambdaLR(ropt, schedule)
    for step in range(20):
        for model, o, s in ((ours, opt, sched), (ref, ropt, rsched)):
            o.zero_grad()
            loss_of(model, step).backward()
            o.step()
            s.step()
        for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
            assert relative(a, b) <= 2e-6, f"step {step}: {name} off by {relative(a, b):.2e}"
    assert opt.group_steps() == [20, 20]
    assert opt.param_groups[0]["lr"] == ropt.param_groups[0]["lr"]


def test_bf16_weights_are_the_rounded_masters():
    torch.manual_seed(1)
    ours, ref = TinyGPT(), TinyGPT()
    ref.load_state_dict(ours.state_dict())
    ours.to(torch.bfloat16)
    ref_params = [p for _, p in ref.named_parameters()]
    with torch.no_grad():  # Both start from the same BF16 values.
        for p in ref_params:
            p.copy_(p.bfloat16().float())
    opt = ckpt.torch.StagedAdamW(groups(ours), lr=1e-3)
    ropt = torch.optim.AdamW(torch_groups(ref), lr=1e-3, foreach=False)
    for step in range(10):
        ropt.zero_grad()
        loss_of(ref, step).backward()
        # The same gradients for both, held exactly in BF16.
        for (_, p), r in zip(ours.named_parameters(), ref_params):
            r.grad = r.grad.bfloat16().float()
            p.grad = r.grad.bfloat16()
        ropt.step()
        opt.step()
        for (name, p), r in zip(ours.named_parameters(), ref_params):
            master = opt.master(p)
            assert torch.equal(p.detach(), master.bfloat16()), name
            assert relative(master, r.detach()) <= 2e-6, name
            agree = master == r.detach()
            assert torch.equal(p.detach()[agree], r.detach().bfloat16()[agree]), name


def fresh(seed=0):
    torch.manual_seed(seed)
    model = TinyGPT()
    return model, ckpt.torch.StagedAdamW(groups(model), lr=1e-3)


def train(model, opt, steps, first=0):
    for step in range(first, first + steps):
        opt.zero_grad()
        loss_of(model, step).backward()
        opt.step()


def snapshot(model, opt):
    out = {}
    for name, p in model.named_parameters():
        out[name] = (p.detach().clone(), opt.master(p), opt.exp_avg(p), opt.exp_avg_sq(p))
    return out


def same(a, b):
    return a.keys() == b.keys() and all(
        all(torch.equal(x, y) for x, y in zip(a[k], b[k])) for k in a)


def test_save_load_and_async_save_round_trip(tmp_path):
    model, opt = fresh()
    ck = ckpt.Checkpointer(tmp_path / "root", opt)
    train(model, opt, 3)
    ck.save(3, extra={"data_position": 3, "rng": torch.get_rng_state()})
    saved = snapshot(model, opt)
    train(model, opt, 2, first=3)
    pending = ck.save_async(5, extra={"data_position": 5})
    train(model, opt, 2, first=5)  # Steps run while the save is written.
    pending.finalize()
    with pytest.raises(ckpt.CkptError, match="already finalized"):
        pending.finalize()
    assert ck.latest == 5
    extra = ck.load(3)
    assert extra["data_position"] == 3 and extra["rng"].dtype == torch.uint8
    assert same(snapshot(model, opt), saved)
    assert opt.group_steps() == [3, 3]
    ck.close()
    # Another optimizer (another seed), as a new process would make it, loads the same state.
    model2, opt2 = fresh(seed=7)
    ck2 = ckpt.Checkpointer(tmp_path / "root", opt2)
    assert ck2.load(3)["data_position"] == 3
    assert same(snapshot(model2, opt2), saved)
    ck2.close()


def test_a_with_block_finalizes_an_async_save_or_abandons_it_when_it_raises(tmp_path):
    model, opt = fresh()
    train(model, opt, 3)
    with ckpt.Checkpointer(tmp_path / "root", opt) as ck:
        ck.save_async(3, extra={"data_position": 3})
        train(model, opt, 1, first=3)  # A step while the save is written.
    assert ck.pending is None
    with pytest.raises(ckpt.CkptError, match="closed"):
        ck.latest
    saved = snapshot(model, opt)
    with pytest.raises(RuntimeError, match="the loop failed"):
        with ckpt.Checkpointer(tmp_path / "root", opt) as ck:
            assert ck.latest == 3
            ck.save_async(4)
            raise RuntimeError("the loop failed")
    with ckpt.Checkpointer(tmp_path / "root", opt) as ck:
        assert ck.latest == 3  # Step 4 was abandoned, not published.
        assert ck.load()["data_position"] == 3
    train(model, opt, 1, first=3)
    assert same(snapshot(model, opt), saved)


def test_a_ctrl_c_anywhere_in_a_with_blocks_exit_still_closes_the_checkpointer(tmp_path):
    """SIGINT at each traced event of __exit__ in turn, an async save in flight: whether the save
    was committed or abandoned, the checkpointer is closed and the root opens again. The first
    two events (the call, and its first line, before any try) are before Python can protect
    anything."""
    import signal
    import sys
    model, opt = fresh()
    train(model, opt, 1)
    target, finished = 3, False
    while not finished and target < 5000:
        root = tmp_path / f"root{target}"
        count = [0]

        def tracer(frame, event, arg):
            if count[0] or (event == "call" and frame.f_code.co_name == "__exit__"):
                count[0] += 1
                if count[0] == target:
                    sys.settrace(None)
                    os.kill(os.getpid(), signal.SIGINT)
                    return None
                return tracer
            return None
        try:
            with ckpt.Checkpointer(root, opt) as ck:
                ck.save_async(1)
                sys.settrace(tracer)
            finished = True  # The block's exit ran before the target event.
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        with pytest.raises(ckpt.CkptError, match="closed"):
            ck.latest
        again = ckpt.Checkpointer(root, opt)
        assert again.latest in (None, 1), target
        again.close()
        target += 1
    assert finished and target > 50


def test_retention_keeps_the_newest_steps_and_the_multiples(tmp_path):
    model, opt = fresh()
    with pytest.raises(ValueError, match="keep_last"):
        ckpt.Checkpointer(tmp_path / "root", opt, keep_last=-1)
    ck = ckpt.Checkpointer(tmp_path / "root", opt, keep_last=2, keep_every=3)
    for step in range(1, 8):
        train(model, opt, 1, first=step - 1)
        if step % 2:
            ck.save(step)
        else:
            ck.save_async(step).finalize()
    saved = snapshot(model, opt)
    ck.close()  # Waits for the background removals.
    steps = sorted(p.name for p in (tmp_path / "root").iterdir() if p.name.startswith("step-"))
    assert steps == ["step-00000003", "step-00000006", "step-00000007"]
    assert not [p.name for p in (tmp_path / "root").iterdir() if p.name.startswith(".deleting")]
    model2, opt2 = fresh(seed=7)
    ck2 = ckpt.Checkpointer(tmp_path / "root", opt2)
    ck2.load()
    assert same(snapshot(model2, opt2), saved)
    ck2.close()


def test_keep_only_and_adopt_follow_a_trainers_own_rotation(tmp_path):
    def steps():
        return sorted(int(p.name[5:]) for p in (tmp_path / "root").iterdir()
                      if p.name.startswith("step-"))

    model, opt = fresh()
    ck = ckpt.Checkpointer(tmp_path / "root", opt)
    states = {}
    for step in range(1, 6):
        train(model, opt, 1, first=step - 1)
        ck.save(step)
        states[step] = snapshot(model, opt)
    # The steps named, LATEST, and the step the state equals (the next load's undo source).
    assert ck.keep_only([2]) == 3  # Steps 1, 3 and 4.
    assert steps() == [2, 5]
    ck.load(2)
    assert ck.keep_only([]) == 0, "the step loaded is the undo source: kept"
    assert steps() == [2, 5]
    # Back to step 2 as LATEST (a run resumed from there): step 3 may be saved again, and the
    # old step 5 is set aside, never deleted, when step 5 is saved anew.
    with pytest.raises(ckpt.CkptError, match="not newer than LATEST"):
        ck.save(3)
    ck.adopt(2)
    assert ck.latest == 2
    for step in range(3, 6):
        train(model, opt, 1, first=step - 1)
        ck.save(step)
    assert same(snapshot(model, opt), states[5])
    assert steps() == [2, 3, 4, 5]
    assert len(list((tmp_path / "root" / "quarantine").iterdir())) == 1
    with pytest.raises(ckpt.CkptError, match="NOT_FOUND"):
        ck.adopt(9)
    ck.close()
    reader = ckpt.Checkpointer(tmp_path / "root", opt, read_only=True)
    with pytest.raises(ckpt.CkptError, match="read_only"):
        reader.keep_only([5])
    reader.close()


def master_chunk_offset(step_dir):
    """The file offset of the first chunk of a master piece in `step_dir` (read from its
    MANIFEST: a 32-byte header, then JSON; docs/formats/ckpt-v1.md). A load reads the masters;
    the weights are the masters rounded and are not read."""
    import json
    manifest = json.loads((step_dir / "MANIFEST").read_bytes()[32:])
    for piece in manifest["pieces"]:
        if manifest["tensors"][piece["tensor"]]["name"].startswith("optimizer.master."):
            return manifest["files"][piece["file"]]["chunks"][piece["first_chunk"]][0]
    raise AssertionError("no master piece in " + str(step_dir))


def damage_a_master(step_dir):
    """Flips a payload byte of the first chunk of a master piece (its chunk header is 24
    bytes): a load of the step then fails DATA_LOSS."""
    data = step_dir / "rank-00000.data"
    raw = bytearray(data.read_bytes())
    raw[master_chunk_offset(step_dir) + 24 + 1] ^= 0x10
    data.write_bytes(bytes(raw))


def test_failed_load_rolls_back_and_steps_afterwards(tmp_path):
    model, opt = fresh()
    ck = ckpt.Checkpointer(tmp_path / "root", opt)
    train(model, opt, 2)
    ck.save(2)
    train(model, opt, 1, first=2)
    before = snapshot(model, opt)
    damage_a_master(tmp_path / "root" / "step-00000002")
    with pytest.raises(ckpt.CkptError) as failure:
        ck.load(2)
    assert failure.value.code == "DATA_LOSS"
    assert "rank-00000.data" in str(failure.value)
    assert same(snapshot(model, opt), before)
    assert opt.lifecycle == "clean"
    train(model, opt, 1, first=3)  # Steps as before.


def test_a_fresh_optimizer_of_mixed_dtypes_resumes_without_writing(tmp_path):
    """A new process's optimizer over parameters of several dtypes loads from a read-only
    handle, and a load that fails restores it as built, writing nothing under the root: its
    rollback keeps the masters in memory (FP32 when the dtypes mix), not a spill on disk."""
    def build(value):
        params = [(f"p{i}", torch.nn.Parameter(torch.full((300,), value + i).to(d)))
                  for i, d in enumerate((torch.float32, torch.bfloat16, torch.float16))]
        return params, ckpt.torch.StagedAdamW(params, lr=1e-2)

    params, opt = build(1.0)
    for _, p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    ck = ckpt.Checkpointer(tmp_path / "root", opt)
    ck.save(1)
    saved = {n: (p.detach().clone(), opt.master(p), opt.exp_avg(p)) for n, p in params}
    ck.close()
    opt.close()

    def files():
        return sorted(str(f.relative_to(tmp_path)) for f in (tmp_path / "root").rglob("*"))

    listing = files()
    params, opt = build(3.0)
    reader = ckpt.Checkpointer(tmp_path / "root", opt, read_only=True)
    reader.load()
    for n, p in params:
        assert torch.equal(p.detach(), saved[n][0]) and torch.equal(opt.master(p), saved[n][1])
        assert torch.equal(opt.exp_avg(p), saved[n][2])
    reader.close()
    opt.close()
    damage_a_master(tmp_path / "root" / "step-00000001")
    params, opt = build(5.0)
    before = {n: (p.detach().clone(), opt.master(p), opt.exp_avg(p)) for n, p in params}
    ck = ckpt.Checkpointer(tmp_path / "root", opt)
    with pytest.raises(ckpt.CkptError) as failure:
        ck.load()
    assert failure.value.code == "DATA_LOSS"
    assert files() == listing, "the undo was written under the root"
    for n, p in params:
        assert all(torch.equal(a, b) for a, b in
                   zip(before[n], (p.detach(), opt.master(p), opt.exp_avg(p)))), n
    assert opt.lifecycle == "clean"
    ck.close()
    opt.close()


def test_bf16_parameters_model_loaded_from_fp32_masters_resume_read_only(tmp_path):
    """BF16 parameters whose masters came from an FP32 source (load_model of another run's
    masters) are no BF16 values, yet still a construction state: a load from a read-only
    handle that fails keeps its undo in memory (FP32), writes nothing under the root, and puts
    those masters back bit for bit."""
    def build(dtype, value):
        params = [(f"p{i}", torch.nn.Parameter(torch.full((300,), value + i).to(dtype)))
                  for i in range(2)]
        return params, ckpt.torch.StagedAdamW(params, lr=1e-2)

    def run(root, dtype):
        params, opt = build(dtype, 1.0)
        for _, p in params:
            p.grad = torch.full_like(p, 0.3)
        opt.step()
        ck = ckpt.Checkpointer(root, opt)
        ck.save(1)
        ck.close()
        opt.close()

    run(tmp_path / "f32", torch.float32)   # Masters 1 - lr * ..., no BF16 values.
    run(tmp_path / "bf16", torch.bfloat16)
    damage_a_master(tmp_path / "bf16" / "step-00000001")
    listing = sorted(str(f) for f in (tmp_path / "bf16").rglob("*"))
    params, opt = build(torch.bfloat16, 7.0)
    ck = ckpt.Checkpointer(tmp_path / "bf16", opt, read_only=True)
    ck.load_model(tmp_path / "f32", masters=True)
    masters = {n: opt.master(p) for n, p in params}
    assert any(not torch.equal(m, m.bfloat16().float()) for m in masters.values())
    with pytest.raises(ckpt.CkptError) as failure:
        ck.load()
    assert failure.value.code == "DATA_LOSS"
    assert sorted(str(f) for f in (tmp_path / "bf16").rglob("*")) == listing
    for n, p in params:
        assert torch.equal(opt.master(p), masters[n]), n
        assert torch.equal(p.detach(), masters[n].bfloat16()), n
        assert not opt.exp_avg(p).any()
    assert opt.lifecycle == "clean"
    ck.close()
    opt.close()


def test_a_parameters_state_is_a_copy_of_that_parameter_alone():
    """master(p), exp_avg(p) and exp_avg_sq(p) hold p's elements only: keeping many of them
    does not keep a copy of the whole state each."""
    params = [torch.nn.Parameter(torch.randn(1000)) for _ in range(20)]
    opt = ckpt.torch.StagedAdamW(params, lr=1e-2)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    for get in (opt.master, opt.exp_avg, opt.exp_avg_sq):
        t = get(params[3])
        storage = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()
        nbytes = storage.nbytes() if hasattr(storage, "nbytes") else storage.size() * 4
        assert nbytes == 1000 * 4
    opt.close()


def test_a_damaged_latest_falls_back_only_when_asked(tmp_path):
    model, opt = fresh()
    ck = ckpt.Checkpointer(tmp_path / "root", opt)
    train(model, opt, 1)
    ck.save(1, extra={"at": 1})
    at_one = snapshot(model, opt)
    train(model, opt, 1, first=1)
    ck.save(2, extra={"at": 2})
    ck.close()
    opt.close()
    damage_a_master(tmp_path / "root" / "step-00000002")
    model, opt = fresh()
    ck = ckpt.Checkpointer(tmp_path / "root", opt)
    before = snapshot(model, opt)
    with pytest.raises(ckpt.CkptError) as failure:
        ck.load()
    assert failure.value.code == "DATA_LOSS"
    assert "fallback=True" in str(failure.value) and "quarantine" in str(failure.value)
    assert same(snapshot(model, opt), before)
    with pytest.raises(ValueError):
        ck.load(2, fallback=True)
    assert ck.load(fallback=True) == {"at": 1}
    assert ck.loaded_step == 1 and ck.skipped_steps == 1
    assert same(snapshot(model, opt), at_one)
    assert ck.latest == 1  # The damaged step 2 went into quarantine/: training saves on.
    assert any(p.name.startswith("step-00000002-") for p in (tmp_path / "root" / "quarantine").iterdir())
    train(model, opt, 1, first=1)
    ck.save(2)


def test_bad_input_raises_clear_errors(tmp_path):
    with pytest.raises(TypeError):
        ckpt.torch.StagedAdamW([torch.zeros(3, dtype=torch.int32, requires_grad=False)])
    with pytest.raises(TypeError, match="not supported"):
        ckpt.torch.StagedAdamW([torch.nn.Parameter(torch.zeros(3, device="meta"))])
    with pytest.raises(TypeError):
        ckpt.torch.StagedAdamW(["not a tensor"])
    with pytest.raises(TypeError):
        ckpt.torch.StagedAdamW(torch.nn.Parameter(torch.zeros(3)))
    with pytest.raises(ValueError, match="lr"):
        ckpt.torch.StagedAdamW([torch.nn.Parameter(torch.zeros(3))], lr=-1)
    with pytest.raises(ValueError, match="betas"):
        ckpt.torch.StagedAdamW([torch.nn.Parameter(torch.zeros(3))], betas=(0.9, 1.5))
    with pytest.raises(ValueError, match="moments"):
        ckpt.torch.StagedAdamW([torch.nn.Parameter(torch.zeros(3))], moments="f8")
    with pytest.raises(ValueError, match="engine must be"):
        ckpt.torch.StagedAdamW([torch.nn.Parameter(torch.zeros(3))], engine="gpu")
    with pytest.raises(ValueError, match="engine='cuda' needs parameters on a CUDA device"):
        ckpt.torch.StagedAdamW([torch.nn.Parameter(torch.zeros(3))], engine="cuda")
    model, opt = fresh()
    loss_of(model, 0).backward()
    opt.param_groups[0]["lr"] = float("nan")
    with pytest.raises(ValueError, match="param group 0: lr must be a finite number"):
        opt.step()
    opt.param_groups[0]["lr"] = 1e-3
    ck = ckpt.Checkpointer(tmp_path / "root", opt)
    with pytest.raises(ckpt.CkptError) as missing:
        ck.load(9)
    assert missing.value.code == "NOT_FOUND"
    ck.save(1)
    with pytest.raises(ckpt.CkptError, match="not newer"):
        ck.save(1)
    with pytest.raises(ckpt.CkptError) as bad_model:
        ck.load_model(tmp_path / "nowhere")
    assert bad_model.value.code == "NOT_FOUND"
    ck.close()
    with pytest.raises(ckpt.CkptError, match="closed"):
        ck.save(2)
    # A checkpoint of another model: its shapes do not fit; refused, nothing changed.
    other = TinyGPT(dim=16)
    other_opt = ckpt.torch.StagedAdamW(groups(other), lr=1e-3)
    ck_other = ckpt.Checkpointer(tmp_path / "root", other_opt)
    before = snapshot(other, other_opt)
    with pytest.raises(ckpt.CkptError) as shapes:
        ck_other.load(1)
    assert shapes.value.code == "INVALID_ARGUMENT" and "embed.weight" in str(shapes.value)
    assert same(snapshot(other, other_opt), before)
    ck_other.close()
    opt.close()
    with pytest.raises(ckpt.CkptError, match="closed"):
        opt.step()


def read_safetensors(path):
    """The tensors of a .safetensors file as float32 (BF16 or F32), parsed by hand."""
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        data = bytearray(raw[8 + n + begin:8 + n + end])
        if info["dtype"] == "BF16":
            t = torch.frombuffer(data, dtype=torch.bfloat16).float()
        else:
            t = torch.frombuffer(data, dtype=torch.float32).clone()
        out[name] = t.reshape(info["shape"])
    return out


def test_load_model_refreshes_masters_and_clears_moments(tmp_path):
    path = os.path.join(TESTDATA, "llama-tied-tiny", "model.safetensors")
    if not os.path.exists(path):
        if os.environ.get("CKPT_REQUIRE_TESTDATA") == "1":
            pytest.fail(f"{TESTDATA} is missing (CKPT_REQUIRE_TESTDATA=1)")
        pytest.skip(f"{TESTDATA} is missing")
    values = read_safetensors(path)
    params = [(name, torch.nn.Parameter(torch.zeros(t.shape, dtype=torch.bfloat16)))
              for name, t in sorted(values.items())]
    opt = ckpt.torch.StagedAdamW(params, lr=1e-3)
    for _, p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    ck = ckpt.Checkpointer(tmp_path / "root", opt)
    ck.load_model(os.path.dirname(path))
    for name, p in params:
        assert torch.equal(opt.master(p), values[name]), name
        assert torch.equal(p.detach().float(), values[name]), name
        assert not opt.exp_avg(p).any() and not opt.exp_avg_sq(p).any(), name
    assert opt.group_steps() == [0]
    assert opt.param_groups[0]["lr"] == 1e-3
    with pytest.raises(ckpt.CkptError, match="unexpected 1"):
        ck.load_model(os.path.dirname(path), rename=[("^model\\.norm\\.", "other.")])
    ck.close()


def test_lifetimes_and_steps_are_checked(tmp_path):
    model, opt = fresh()
    ck = ckpt.Checkpointer(tmp_path / "root", opt)
    train(model, opt, 1)
    for bad in (-1, 2 ** 64, 3.7, True):
        with pytest.raises(ValueError, match="step"):
            ck.save(bad)
    # A dropped async save is finalized by the next call, not left in flight forever.
    ck.save_async(1)
    ck.save(2)
    assert ck.latest == 2
    # A pending save outlived by its checkpointer raises instead of touching freed memory.
    pending = ck.save_async(3)
    ck.close()
    with pytest.raises(ckpt.CkptError, match="checkpointer is closed"):
        pending.finalize()
    assert pending.writer_done
    with pytest.raises(ckpt.CkptError, match="closed"):
        ck.latest
    # Closing the optimizer closes its checkpointers first (a save in flight is abandoned).
    ck2 = ckpt.Checkpointer(tmp_path / "root", opt)
    pending = ck2.save_async(4)
    opt.close()
    with pytest.raises(ckpt.CkptError, match="closed"):
        pending.finalize()
    with pytest.raises(ckpt.CkptError, match="closed"):
        ck2.save(5)
    # The root was left consistent: LATEST is step 2 (the abandoned saves published nothing).
    model3, opt3 = fresh(seed=3)
    ck3 = ckpt.Checkpointer(tmp_path / "root", opt3)
    assert ck3.latest == 2
    ck3.close()


def test_parameters_keep_their_storage_and_may_move_within_their_device(tmp_path):
    model, opt = fresh()
    ref, ropt = fresh()
    storages = [p.data_ptr() for p in model.parameters()]
    train(model, opt, 1)
    train(ref, ropt, 1)
    # Each parameter is stepped in place, in its own storage (nothing rebinds .data).
    assert [p.data_ptr() for p in model.parameters()] == storages
    model.share_memory()  # New storage for every parameter: read where it is now.
    ck = ckpt.Checkpointer(tmp_path / "root", opt)
    train(model, opt, 2, first=1)
    train(ref, ropt, 2, first=1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    ck.save(3)
    model.half()  # Another dtype: refused, naming the parameter.
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with pytest.raises(ckpt.CkptError, match="changed"):
        opt.step()
