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
@pytest.mark.parametrize("overlap", [False, True])
def test_the_cpu_engine_steps_cuda_parameters_as_the_cuda_engine_does(moments, overlap):
    """engine="cpu": CUDA parameters' gradients go to the host (overlapped: each as backward
    finishes it, while backward goes on), every core steps them, and the weights come back in
    place: bit for bit what the CUDA engine writes, state included."""
    models, opts = [], []
    for engine in ("auto", "cpu"):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 64)).to("cuda", torch.bfloat16)
        models.append(m)
        opts.append(ckpt.torch.StagedAdamW(list(m.named_parameters()), lr=1e-2,
                                           weight_decay=0.1, moments=moments, engine=engine,
                                           unit_bytes=4096, overlap=overlap and engine == "cpu"))
    assert opts[0]._device.type == "cuda" and opts[1]._device.type == "cpu"
    storages = [p.data_ptr() for p in models[1].parameters()]
    for s in range(4):
        for model, opt in zip(models, opts):
            g = torch.Generator(device="cuda").manual_seed(100 + s)
            x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16, generator=g)
            opt.zero_grad()
            model(x).float().pow(2).mean().backward()
            if opt._ov.enabled:
                opt._drain_overlap()  # Every copy landed and handed over: all speculated.
            opt.step()
            if opt._ov.enabled:
                speculated, held = opt.last_overlap
                assert speculated > 0 and held
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


@pytest.mark.skipif(not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"),
                    reason="post-accumulate-grad hooks: torch >= 2.1")
@pytest.mark.parametrize("clip", [None, 1e9, 1e-3])
def test_an_overlapped_cpu_engine_step_of_cuda_and_cpu_parameters_is_the_plain_one(clip):
    """engine="cpu", overlap=True, a model with CUDA layers and a CPU layer in one optimizer:
    the CPU layer's gradients reach ckpt where they are, the CUDA ones through the host mirror,
    and a step whose clipping fires is redone; every step, weights and state equal the plain
    CPU-engine step's bit for bit."""
    def build():
        torch.manual_seed(0)
        head = torch.nn.Linear(64, 16).to(torch.bfloat16)  # Stays on the CPU.
        body = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                                   torch.nn.Linear(64, 64)).to("cuda", torch.bfloat16)
        return body, head

    runs = []
    for overlap in (False, True):
        body, head = build()
        params = [("body." + n, p) for n, p in body.named_parameters()] + \
                 [("head." + n, p) for n, p in head.named_parameters()]
        opt = ckpt.torch.StagedAdamW(params, lr=1e-2, weight_decay=0.1, engine="cpu",
                                     unit_bytes=2048, overlap=overlap)
        assert opt._device.type == "cpu" and (opt._mirror is not None)
        runs.append((body, head, opt))
    for step in range(4):
        for body, head, opt in runs:
            g = torch.Generator(device="cuda").manual_seed(200 + step)
            x = torch.randn(16, 32, device="cuda", dtype=torch.bfloat16, generator=g)
            opt.zero_grad()
            head(body(x).cpu()).float().pow(2).mean().backward()
            opt._drain_overlap()  # A no-op for the plain one.
            if clip is not None:
                opt.clip_grad_norm(clip)
            opt.step()
        last = runs[1][2].last_overlap
        if clip == 1e-3 and step > 0:
            assert last is None  # Clipping fired at the first step: plain from then on.
        else:
            assert last[0] > 0 and last[1] == (clip != 1e-3), (step, last)
        for a, b in zip(list(runs[0][0].parameters()) + list(runs[0][1].parameters()),
                        list(runs[1][0].parameters()) + list(runs[1][1].parameters())):
            assert torch.equal(a, b), step
    sa, sb = runs[0][2].state_dict()["state"], runs[1][2].state_dict()["state"]
    for k in sa:
        for key in sa[k]:
            assert torch.equal(torch.as_tensor(sa[k][key]), torch.as_tensor(sb[k][key]))
    for _, _, opt in runs:
        opt.close()


@pytest.mark.skipif(not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"),
                    reason="post-accumulate-grad hooks: torch >= 2.1")
def test_a_gradient_replaced_after_backward_is_stepped_by_the_cpu_engines_overlapped_step():
    """p.grad = p.grad * 0.5 between backward and step() makes a new tensor at version 0, as
    the one the hook copied to the host mirror was: the overlapped CPU-engine step sees the
    replacement, redoes the step from the new gradient, and equals the plain step bit for
    bit."""
    runs = []
    for overlap in (False, True):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 64)).to("cuda", torch.bfloat16)
        runs.append((m, ckpt.torch.StagedAdamW(list(m.named_parameters()), lr=1e-2,
                                               engine="cpu", unit_bytes=4096, overlap=overlap)))
    for s in range(3):
        for m, opt in runs:
            g = torch.Generator(device="cuda").manual_seed(300 + s)
            x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16, generator=g)
            opt.zero_grad()
            m(x).float().pow(2).mean().backward()
            opt._drain_overlap()
            first = m[0].weight
            first.grad = first.grad * 0.5  # A new tensor, not an in-place change.
            opt.step()
        last = runs[1][1].last_overlap
        if s == 0:
            assert last[0] > 0 and last[1] is False  # Redone from the replaced gradient.
        else:
            assert last is None  # Changed after release: the next steps run plainly.
        for a, b in zip(runs[0][0].parameters(), runs[1][0].parameters()):
            assert torch.equal(a, b), s
    for _, opt in runs:
        opt.close()


@pytest.mark.skipif(not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"),
                    reason="post-accumulate-grad hooks: torch >= 2.1")
@pytest.mark.parametrize("clip", [None, 1e-3])
def test_each_module_waits_for_its_weights_copied_back_by_the_cpu_engines_gated_step(clip):
    """engine="cpu", overlap="forward": the weights go back to the GPU on the host mirror's
    stream and each module's next forward waits for its own copies. The mirror's stream is held
    back here (a spin kernel ahead of the copies), so that a read that did not wait sees the
    weights from before the step (checked); the next forward's outputs, the weights and the
    state still equal the plain CPU-engine step's bit for bit. Clipping at 1e-3 fires every
    step: a redone step, then plain steps, whose copies back are gated all the same."""
    runs = []
    for overlap in (False, "forward"):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 64)).to("cuda", torch.bfloat16)
        runs.append((m, ckpt.torch.StagedAdamW(list(m.named_parameters()), lr=1e-2,
                                               engine="cpu", unit_bytes=4096, overlap=overlap)))
    gated = runs[1][1]
    copy_in = gated._mirror.copy_in

    def held_back(*args, **kwargs):  # The copies queue behind ~50 ms of spinning.
        if gated._mirror.stream is None:
            gated._mirror.stream = torch.cuda.Stream(gated._mirror.device)
        with torch.cuda.stream(gated._mirror.stream):
            torch.cuda._sleep(100_000_000)
        return copy_in(*args, **kwargs)

    gated._mirror.copy_in = held_back
    first = runs[1][0][0].weight
    for s in range(5):
        outs = []
        for m, opt in runs:
            g = torch.Generator(device="cuda").manual_seed(400 + s)
            x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16, generator=g)
            opt.zero_grad()
            out = m(x)
            outs.append(out.detach().clone())
            out.float().pow(2).mean().backward()
            opt._drain_overlap()
            if clip is not None:
                opt.clip_grad_norm(clip)
            if opt is gated:
                before = first.detach().clone()
            opt.step()
            if opt is gated:
                assert gated._ov.gated, "open until the next forward"
            if opt is gated and s == 0:  # The control: the window a forward must wait out.
                early = first.detach().clone()  # Not waited for: the copy has not run.
                torch.cuda.synchronize()
                assert torch.equal(early, before)
                assert not torch.equal(first, before)
            if opt is gated and s == 2:  # wait_for_step: the current stream waits, no host sync.
                gated.wait_for_step()
                assert not gated._ov.gated
                assert torch.equal(first, runs[0][0][0].weight)
        # Steps 2 and 4: the forward above ran while the last step's copies were held back.
        assert torch.equal(outs[0], outs[1]), s
    # A forward that waits for every module, then the weights and the state.
    runs[1][0](torch.zeros(1, 64, device="cuda", dtype=torch.bfloat16))
    assert not gated._ov.gated and gated._ov.gate_hook is None
    for a, b in zip(runs[0][0].parameters(), runs[1][0].parameters()):
        assert torch.equal(a, b)
    sa, sb = runs[0][1].state_dict()["state"], runs[1][1].state_dict()["state"]
    for k in sa:
        for key in sa[k]:
            assert torch.equal(torch.as_tensor(sa[k][key]), torch.as_tensor(sb[k][key]))
    for _, opt in runs:
        opt.close()
