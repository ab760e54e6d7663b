"""ckpt.torch.StagedAdamW on the CUDA engine (CUDA parameters): skipped without a device.

A load changes ckpt's masters only; the package then writes the parameters from them on the
device, on the current stream (ckpt_optimizer_write_weights), with no host round trip."""
import pytest
import torch

import ckpt
import ckpt.torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def model_and_optimizer(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 64)).to("cuda", torch.bfloat16)
    opt = ckpt.torch.StagedAdamW(list(model.named_parameters()), lr=1e-2, weight_decay=0.1)
    return model, opt


def train(model, opt, steps, first=0):
    for s in range(first, first + steps):
        g = torch.Generator(device="cuda").manual_seed(100 + s)
        x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16, generator=g)
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        opt.step()


def test_a_load_writes_the_cuda_parameters_from_the_masters(tmp_path):
    model, opt = model_and_optimizer(0)
    ck = ckpt.Checkpointer(tmp_path / "root", opt)
    train(model, opt, 2)
    ck.save(2)
    saved = [p.detach().clone() for p in model.parameters()]
    masters = [opt.master(p) for p in model.parameters()]
    train(model, opt, 2, first=2)
    assert not all(torch.equal(a, b) for a, b in zip(saved, model.parameters()))
    ck.load(2)
    for a, p, m in zip(saved, model.parameters(), masters):
        assert p.device.type == "cuda"
        assert torch.equal(p.detach(), a)
        assert torch.equal(p.detach().cpu(), m.to(torch.bfloat16).view(p.shape))
    ck.close()
    # A new optimizer over another initialisation, as a new process makes it, loads the same.
    model2, opt2 = model_and_optimizer(7)
    ck2 = ckpt.Checkpointer(tmp_path / "root", opt2)
    ck2.load()
    for a, p in zip(saved, model2.parameters()):
        assert torch.equal(p.detach(), a)
    # And steps on as the first optimizer does.
    train(model, opt, 1, first=2)
    train(model2, opt2, 1, first=2)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p.detach(), q.detach())
    ck2.close()


def test_parity_with_torch_adamw_on_cuda_parameters_stepped_in_place():
    torch.manual_seed(0)
    ours = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                               torch.nn.Linear(256, 64)).cuda()
    ref = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                              torch.nn.Linear(256, 64)).cuda()
    ref.load_state_dict(ours.state_dict())
    storages = [p.data_ptr() for p in ours.parameters()]
    opt = ckpt.torch.StagedAdamW(list(ours.named_parameters()), lr=1e-3, weight_decay=0.1)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
    for step in range(10):
        g = torch.Generator(device="cuda").manual_seed(100 + step)
        x = torch.randn(32, 64, device="cuda", generator=g)
        for model, o in ((ours, opt), (ref, ropt)):
            o.zero_grad()
            model(x).pow(2).mean().backward()
            o.step()
    assert [p.data_ptr() for p in ours.parameters()] == storages  # Written in place.
    for a, b in zip(ours.parameters(), ref.parameters()):
        rel = ((a.double() - b.double()).norm() / b.double().norm()).item()
        assert rel <= 2e-6, rel
    sd = opt.state_dict()  # And the state dict loads into torch's AdamW.
    ropt.load_state_dict(sd)
    opt.close()


@pytest.mark.parametrize("moments", ["f32", "bf16"])
def test_the_cpu_engine_steps_cuda_parameters_as_the_cuda_engine_does(moments):
    """engine="cpu": CUDA parameters' gradients go to the host, every core steps them, and the
    weights come back in place: bit for bit what the CUDA engine writes, state included."""
    models, opts = [], []
    for engine in ("auto", "cpu"):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 64)).to("cuda", torch.bfloat16)
        models.append(m)
        opts.append(ckpt.torch.StagedAdamW(list(m.named_parameters()), lr=1e-2,
                                           weight_decay=0.1, moments=moments, engine=engine))
    assert opts[0]._device.type == "cuda" and opts[1]._device.type == "cpu"
    storages = [p.data_ptr() for p in models[1].parameters()]
    for model, opt in zip(models, opts):
        train(model, opt, 4)
    assert [p.data_ptr() for p in models[1].parameters()] == storages
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)
    sa, sb = opts[0].state_dict()["state"], opts[1].state_dict()["state"]
    for k in sa:
        for key in sa[k]:
            assert torch.equal(torch.as_tensor(sa[k][key]).cpu(), torch.as_tensor(sb[k][key]).cpu())
    for opt in opts:
        opt.close()


@pytest.mark.parametrize("mixed", [False, True])
def test_construction_copies_the_weights_to_the_host_one_parameter_at_a_time(mixed):
    """Nothing the size of the model is made on the GPU (one near full has no room for the
    model twice): at most one parameter's worth, and the masters are the weights."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)]).to(
        "cuda", torch.bfloat16)
    if mixed:  # Two dtypes: the flat byte buffer.
        model[0].float()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    opt = ckpt.torch.StagedAdamW(list(model.named_parameters()), lr=1e-3)
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert torch.cuda.max_memory_allocated() - before <= largest < total // 4
    for p in model.parameters():
        assert torch.equal(opt.master(p).reshape(-1), p.detach().float().cpu().reshape(-1))
    opt.close()
