"""ckpt.torch.StagedMuon against torch.optim.Muon (torch >= 2.9) and against the algorithm written
out with torch ops (every torch): the momentum buffer bit for bit, the parameters within the
documented tolerance (docs/python.md: the Newton-Schulz products sum in another order than
torch's), the hybrid's AdamW groups as torch.optim.AdamW, torch-shaped state dicts both ways, and
the refusals. CKPT_TEST_DEVICE=cuda (GPU host) runs them on CUDA tensors: the CUDA engine's Muon
against torch's on the GPU (docs/design/muon.md)."""
import math
import os

import pytest
import torch

import ckpt
import ckpt.torch
from ckpt import CkptError

DEVICE = torch.device(os.environ.get("CKPT_TEST_DEVICE", "cpu"))
HAS_MUON = hasattr(torch.optim, "Muon")
needs_torch_muon = pytest.mark.skipif(not HAS_MUON, reason="torch.optim.Muon: torch >= 2.9")
SHAPES = [(64, 32), (32, 96), (0, 24), (48, 48), (1, 20)]  # (0, 24): a matrix of no elements.
# docs/python.md: after k steps, |p - p_ref| <= k * 0.003 * lr' against the algorithm written out
# with FP32 products (lr' the matrix's adjusted lr), and k * 0.01 * lr' against torch.optim.Muon,
# whose BF16 products some CPUs run in other precisions (AMX: up to 0.008 measured at step 1).
# On the GPU, whose products (tensor cores) sum in blocks of another order than the CPU
# reference's, k * 0.01 * lr' against both (measured: 0.005 at step 1).
TOLERANCE = 0.003 if DEVICE.type == "cpu" else 0.01
TORCH_TOLERANCE = 0.01


def adjusted(lr, shape, adjust_lr_fn):
    a, b = shape
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(a, b))
    return lr * math.sqrt(max(1, a / b))


def orthogonalised(u, coefficients=(3.4445, -4.775, 2.0315), steps=5, eps=1e-7):
    """Newton-Schulz as torch's Muon runs it: BF16 tensors, products summed in FP32."""
    a, b, c = coefficients
    x = u.bfloat16()
    tall = u.shape[0] > u.shape[1]
    if tall:
        x = x.T
    x = x / x.float().norm().bfloat16().clamp(min=eps)
    for _ in range(steps):
        gram = (x.float() @ x.float().T).bfloat16()
        poly = (b * gram.float() + c * (gram.float() @ gram.float())).bfloat16()
        x = (a * x.float() + poly.float() @ x.float()).bfloat16()
    return x.T if tall else x


class ReferenceMuon:
    """Muon written out with torch ops (lerp, the weight decay, the adjusted lr)."""

    def __init__(self, params, lr, weight_decay, momentum, nesterov, adjust_lr_fn):
        self.params, self.lr, self.wd = params, lr, weight_decay
        self.mu, self.nesterov, self.adjust = momentum, nesterov, adjust_lr_fn
        self.buf = [torch.zeros_like(p) for p in params]

    @torch.no_grad()
    def step(self):
        for p, buf in zip(self.params, self.buf):
            g = p.grad
            buf.lerp_(g, 1 - self.mu)
            u = g.lerp(buf, self.mu) if self.nesterov else buf
            # On the CPU whatever the device: FP32 products summed in one order (a GPU's sum
            # in another would move BF16 roundings of its own).
            o = orthogonalised(u.cpu()).to(u.device)
            p.mul_(1 - self.lr * self.wd)
            p.add_(o.float(), alpha=-adjusted(self.lr, p.shape, self.adjust))


def matrices(seed):
    torch.manual_seed(seed)
    return [(torch.randn(s) * 0.1).to(DEVICE) for s in SHAPES]


def run_pair(reference_of, nesterov, adjust_lr_fn, steps=6, **kw):
    """The same matrices and gradients through StagedMuon and a reference; yields after each
    step (ours, theirs, the reference's momentum of each) for the caller to compare."""
    ps = matrices(0)
    ours = [p.clone().requires_grad_() for p in ps]
    theirs = [p.clone().requires_grad_() for p in ps]
    opt = ckpt.torch.StagedMuon(ours, lr=0.02, weight_decay=0.1, nesterov=nesterov,
                                adjust_lr_fn=adjust_lr_fn, threads=2, **kw)
    ref, momentum = reference_of(theirs, nesterov, adjust_lr_fn)
    gen = torch.Generator().manual_seed(7)
    for step in range(steps):
        for x, y in zip(ours, theirs):
            g = torch.randn(x.shape, generator=gen).to(DEVICE)
            x.grad, y.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        yield step, opt, ours, theirs, [momentum(y) for y in theirs]
    opt.close()


def check_close(step, ours, theirs, adjust_lr_fn, tolerance=TOLERANCE):
    for x, y in zip(ours, theirs):
        assert x.shape == y.shape
        if x.numel() == 0:
            continue
        bound = (step + 1) * tolerance * adjusted(0.02, x.shape, adjust_lr_fn)
        assert (x.detach() - y.detach()).abs().max().item() <= bound, (step, tuple(x.shape))


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_staged_muon_follows_muon_written_out_with_torch_ops(nesterov, adjust_lr_fn):
    def reference(params, nest, adjust):
        ref = ReferenceMuon(params, 0.02, 0.1, 0.95, nest, adjust)
        return ref, lambda p: next(b for q, b in zip(ref.params, ref.buf) if q is p)
    for step, opt, ours, theirs, bufs in run_pair(reference, nesterov, adjust_lr_fn):
        for x, buf in zip(ours, bufs):
            assert torch.equal(opt.state[x]["momentum_buffer"], buf.cpu()), step
        check_close(step, ours, theirs, adjust_lr_fn)


@needs_torch_muon
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw"])
def test_staged_muon_matches_torch_optim_muon(nesterov, adjust_lr_fn):
    def reference(params, nest, adjust):
        ref = torch.optim.Muon(params, lr=0.02, weight_decay=0.1, nesterov=nest,
                               adjust_lr_fn=adjust)
        return ref, lambda p: ref.state[p]["momentum_buffer"]
    for step, opt, ours, theirs, bufs in run_pair(reference, nesterov, adjust_lr_fn):
        for x, buf in zip(ours, bufs):
            assert torch.equal(opt.state[x]["momentum_buffer"], buf.cpu()), step
        check_close(step, ours, theirs, adjust_lr_fn, TORCH_TOLERANCE)


def hybrid_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(40, 16), torch.nn.Linear(16, 32),
                               torch.nn.LayerNorm(32), torch.nn.Linear(32, 40)).to(DEVICE)


def split(model):
    """Muon for the hidden matrices, AdamW for the embedding, norms, biases and head: the
    usual recipe."""
    named = list(model.named_parameters())
    muon = [(n, p) for n, p in named if p.ndim == 2 and n.startswith("1.")]
    rest = [(n, p) for n, p in named if not (p.ndim == 2 and n.startswith("1."))]
    return muon, rest


def test_the_hybrids_adamw_group_steps_as_torch_adamw_and_its_muon_group_as_muon():
    a, b = hybrid_model(0), hybrid_model(0)
    muon_a, rest_a = split(a)
    muon_b, rest_b = split(b)
    ours = ckpt.torch.StagedMuon(
        [{"params": muon_a}, {"params": rest_a, "use_muon": False}], lr=0.02, weight_decay=0.1,
        adamw_lr=3e-3, adamw_weight_decay=0.01, threads=2)
    ref_muon = ReferenceMuon([p for _, p in muon_b], 0.02, 0.1, 0.95, True, None)
    ref_adamw = torch.optim.AdamW([p for _, p in rest_b], lr=3e-3, weight_decay=0.01)
    assert ours.param_groups[1]["lr"] == 3e-3 and ours.param_groups[1]["eps"] == 1e-8
    assert ours.param_groups[0]["use_muon"] and not ours.param_groups[1]["use_muon"]
    gen = torch.Generator().manual_seed(3)
    for step in range(4):
        x = torch.randint(0, 40, (8,), generator=gen).to(DEVICE)
        for m in (a, b):
            m.zero_grad()
            torch.nn.functional.cross_entropy(m(x), x).backward()
        ours.step()
        ref_muon.step()
        ref_adamw.step()
        for (name, p), (_, q) in zip(rest_a, rest_b):
            # ckpt's AdamW is torch's to the last bits of its own kernel's rounding.
            assert torch.allclose(p, q, rtol=0, atol=1e-6), (step, name)
            assert "exp_avg" in ours.state[p] and "momentum_buffer" not in ours.state[p]
        for (name, p), (_, q) in zip(muon_a, muon_b):
            bound = (step + 1) * TOLERANCE * adjusted(0.02, p.shape, None)
            assert (p - q).abs().max().item() <= bound, (step, name)
            assert set(ours.state[p]) == {"step", "momentum_buffer", "master"}
    ours.close()


def test_a_state_dict_round_trip_continues_exactly():
    ps = matrices(1)
    a = [p.clone().requires_grad_() for p in ps]
    b = [p.clone().requires_grad_() for p in ps]
    first = ckpt.torch.StagedMuon(a, lr=0.02, threads=2)
    gen = torch.Generator().manual_seed(5)
    grads = [[torch.randn(p.shape, generator=gen).to(DEVICE) for p in ps] for _ in range(3)]
    for g in grads[:2]:
        for p, x in zip(a, g):
            p.grad = x.clone()
        first.step()
    sd = first.state_dict()
    assert set(sd["state"][0]) == {"step", "momentum_buffer", "master"}
    with torch.no_grad():
        for p, q in zip(b, a):
            p.copy_(q)
    second = ckpt.torch.StagedMuon(b, lr=0.5, threads=2)  # The dict's lr replaces this one.
    second.load_state_dict(sd)
    assert second.param_groups[0]["lr"] == 0.02
    for opt, params in ((first, a), (second, b)):
        for p, x in zip(params, grads[2]):
            p.grad = x.clone()
        opt.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q)
    first.close()
    second.close()


@needs_torch_muon
def test_state_dicts_go_both_ways_with_torch_optim_muon():
    ps = matrices(2)
    ours_p = [p.clone().requires_grad_() for p in ps]
    torch_p = [p.clone().requires_grad_() for p in ps]
    ours = ckpt.torch.StagedMuon(ours_p, lr=0.02, threads=2)
    theirs = torch.optim.Muon(torch_p, lr=0.02)
    gen = torch.Generator().manual_seed(9)
    for p, q in zip(ours_p, torch_p):
        g = torch.randn(p.shape, generator=gen).to(DEVICE)
        p.grad, q.grad = g.clone(), g.clone()
    ours.step()
    theirs.step()
    # torch's Muon takes ours (it ignores "step" and "master")...
    other = torch.optim.Muon([p.clone().requires_grad_() for p in ps], lr=0.1)
    other.load_state_dict(ours.state_dict())
    for i, p in enumerate(other.param_groups[0]["params"]):
        assert torch.equal(other.state[p]["momentum_buffer"].cpu(),
                           ours.state[ours_p[i]]["momentum_buffer"])
    # ...and ours takes torch's: the momentum as it is, a parameter stepped once.
    fresh = ckpt.torch.StagedMuon([p.detach().clone().requires_grad_() for p in torch_p],
                                  lr=0.1, threads=2)
    fresh.load_state_dict(theirs.state_dict())
    for i, p in enumerate(fresh.param_groups[0]["params"]):
        assert torch.equal(fresh.state[p]["momentum_buffer"],
                           theirs.state[torch_p[i]]["momentum_buffer"].cpu())
        assert fresh.state[p]["step"].item() == 1
    for opt in (ours, fresh):
        opt.close()


def test_refusals_name_what_is_wrong():
    vector = torch.zeros(5, requires_grad=True, device=DEVICE)
    with pytest.raises(ValueError, match=r"parameter 1 of the group has size \(5,\)"):
        ckpt.torch.StagedMuon([torch.zeros(4, 4, requires_grad=True, device=DEVICE), vector])
    with pytest.raises(ValueError, match=r"bias has size \(5,\)"):
        ckpt.torch.StagedMuon([("w", torch.zeros(4, 4, requires_grad=True)), ("bias", vector)])
    with pytest.raises(ValueError, match="ns_steps"):
        ckpt.torch.StagedMuon([torch.zeros(4, 4, requires_grad=True)], ns_steps=100)
    with pytest.raises(ValueError, match="param group 1: momentum"):
        ckpt.torch.StagedMuon([{"params": [torch.zeros(4, 4, requires_grad=True)]},
                               {"params": [torch.zeros(3, 4, requires_grad=True)],
                                "momentum": -1.0}])
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        ckpt.torch.StagedMuon([torch.zeros(4, 4, requires_grad=True)], adjust_lr_fn="fast")
    with pytest.raises(ValueError, match="use_muon"):
        ckpt.torch.StagedMuon([{"params": [torch.zeros(4, 4, requires_grad=True)],
                                "use_muon": 1}])


def steps(opt, params, seed, n):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(DEVICE)
        opt.step()


def test_a_checkpointed_hybrid_resumes_bit_for_bit(tmp_path):
    a, b = hybrid_model(0), hybrid_model(1)  # b starts elsewhere: the load must set it.
    opt_a = ckpt.torch.StagedMuon([{"params": split(a)[0]},
                                   {"params": split(a)[1], "use_muon": False}],
                                  lr=0.02, adamw_lr=3e-3, threads=2, adjust_lr_fn="match_rms_adamw")
    opt_b = ckpt.torch.StagedMuon([{"params": split(b)[0]},
                                   {"params": split(b)[1], "use_muon": False}],
                                  lr=0.5, momentum=0.5, adamw_lr=1e-4, threads=2)
    ck_a = ckpt.Checkpointer(str(tmp_path / "run"), opt_a)
    params_a = [p for _, p in a.named_parameters()]
    params_b = [p for _, p in b.named_parameters()]
    steps(opt_a, params_a, 1, 2)
    saved = {n: opt_a.master(q).clone() for n, q in a.named_parameters()}
    ck_a.save(2)
    pending = ck_a.save_async(3)  # The same state again, written while the steps go on.
    steps(opt_a, params_a, 2, 2)
    pending.finalize()
    ck_a.close()  # One store handle per root in a process.
    ck_b = ckpt.Checkpointer(str(tmp_path / "run"), opt_b)
    ck_b.load(3)
    assert opt_b.param_groups[0]["momentum"] == 0.95
    assert opt_b.param_groups[0]["lr"] == 0.02
    assert opt_b.param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"
    assert opt_b.param_groups[1]["lr"] == 3e-3
    steps(opt_b, params_b, 2, 2)
    for p, q in zip(params_a, params_b):
        assert torch.equal(p, q)
    for p, q in zip(split(a)[0], split(b)[0]):
        assert torch.equal(opt_a.state[p[1]]["momentum_buffer"],
                           opt_b.state[q[1]]["momentum_buffer"])
    ck_b.close()
    # An AdamW optimizer over the same parameters refuses the step by group.
    c = hybrid_model(0)
    adamw = ckpt.torch.StagedAdamW(c.named_parameters(), lr=1e-3)
    ck_c = ckpt.Checkpointer(str(tmp_path / "run"), adamw)
    with pytest.raises(CkptError, match="Muon's in the checkpoint and AdamW's here"):
        ck_c.load(3)
    # What the refusal offers: the masters, bit for bit, and the moments afresh.
    ck_c.load_model(str(tmp_path / "run"), masters=True)
    for name, p in c.named_parameters():
        assert torch.equal(adamw.master(p), saved[name]), name
        assert not adamw.exp_avg(p).any(), name
    hf = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "testdata",
                      "hf_tiny_models", "qwen3-tiny")
    assert os.path.isdir(hf), hf  # CI has ../shared beside the clone.
    with pytest.raises(CkptError, match="no optimizer masters"):
        ck_c.load_model(hf, masters=True)
    ck_c.close()
    for opt in (opt_a, opt_b, adamw):
        opt.close()


def test_shards_and_state_dicts_of_another_algorithm():
    ps = matrices(3)
    params = [p.clone().requires_grad_() for p in ps]
    vector = torch.zeros(6, requires_grad=True, device=DEVICE)
    opt = ckpt.torch.StagedMuon([{"params": params}, {"params": [vector], "use_muon": False}],
                                lr=0.02, threads=2)
    steps(opt, params + [vector], 4, 2)
    shard = opt.local_state_dict()
    assert set(shard["state"][0]) == {"step", "momentum_buffer", "master"}
    before = [opt.state[p]["momentum_buffer"].clone() for p in params]
    steps(opt, params + [vector], 5, 1)
    opt.load_state_dict(shard)  # Its own shard back: the state of two steps ago.
    for p, b in zip(params, before):
        assert torch.equal(opt.state[p]["momentum_buffer"], b)
    # A dict whose group 0 is AdamW's is refused with nothing changed.
    whole = opt.state_dict()
    whole["param_groups"][0]["use_muon"] = False
    with pytest.raises(ValueError, match="param group 0 is AdamW's in the state dict"):
        opt.load_state_dict(whole)
    assert opt.param_groups[0]["use_muon"]
    for p, b in zip(params, before):
        assert torch.equal(opt.state[p]["momentum_buffer"], b)
    steps(opt, params + [vector], 6, 1)  # Still steps.
    with pytest.raises(ValueError, match="StagedMuon"):
        ckpt.torch.StagedAdamW([{"params": [torch.zeros(2, 2, requires_grad=True)],
                                 "use_muon": True}])
    opt.close()


def test_a_load_takes_the_checkpoints_lr_rule_and_async_saves_survive_added_matrices(tmp_path):
    ps = matrices(4)
    a = [p.clone().requires_grad_() for p in ps]
    opt = ckpt.torch.StagedMuon(a, lr=0.02, threads=2)  # adjust_lr_fn None: "original".
    ck = ckpt.Checkpointer(str(tmp_path / "run"), opt)
    steps(opt, a, 7, 1)
    ck.save_async(1).finalize()
    # Matrices larger than any unit before: the next async save's copies still fit.
    big = [torch.randn(1024, 1024, device=DEVICE).requires_grad_() for _ in range(3)]
    opt.add_param_group({"params": big})
    pending = ck.save_async(2)
    steps(opt, a + big, 8, 2)
    pending.finalize()
    ck.close()
    b = [p.clone().requires_grad_() for p in ps]
    other = ckpt.torch.StagedMuon(b, lr=0.02, adjust_lr_fn="match_rms_adamw", threads=2)
    ck2 = ckpt.Checkpointer(str(tmp_path / "run"), other)
    ck2.load(1)
    assert other.param_groups[0]["adjust_lr_fn"] is None
    ck2.close()
    other.close()
    opt.close()
