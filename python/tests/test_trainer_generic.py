"""StagedAdamW in the trainers people use, as generic torch code, with nothing of ckpt's
integrations: each trainer's own checkpoints (the optimizer through state_dict) and its resume
end bit for bit where an uninterrupted run ends, with the resumed run started from other
weights (which the resume must replace).

- HF transformers' Trainer: `optimizers=(StagedAdamW(...), scheduler)`, `resume_from_checkpoint`,
  with BF16 parameters, gradient accumulation and tied embeddings (the tiny transformers-written
  Llama of ../shared/testdata).
- Lightning: `configure_optimizers` returning StagedAdamW (Lightning wraps it in an object that
  copies its __dict__), `ModelCheckpoint`, `fit(ckpt_path=...)`.
- Accelerate: `prepare()` with its defaults, `save_state` / `load_state`, and `save_model`
  (safetensors) writing every tensor.
- PEFT: LoRA adapters (FP32) over a frozen BF16 base, the optimizer given the trainable
  parameters or all of them, equal torch AdamW; the base does not move.
- torch.distributed.checkpoint: `get_state_dict` leaves the state as it is, and `dcp.save`,
  `dcp.load` and `set_state_dict` round trip exactly.

Needs the current stack (the virtual environment); skipped under Debian's torch, which has none
of these libraries."""
import os

import pytest
import torch

import ckpt.torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The testdata beside the clone, or where CKPT_HF_TESTDATA says (the GPU host has a copy).
LLAMA = os.path.join(os.environ.get("CKPT_HF_TESTDATA") or
                     os.path.join(REPO, "..", "shared", "testdata", "hf_tiny_models"),
                     "llama-tied-tiny")


def llama_path():
    if not os.path.exists(os.path.join(LLAMA, "model.safetensors")):
        if os.environ.get("CKPT_REQUIRE_TESTDATA") == "1":
            pytest.fail(f"{LLAMA} is missing (CKPT_REQUIRE_TESTDATA=1)")
        pytest.skip(f"{LLAMA} is missing")
    return LLAMA


class Tokens(torch.utils.data.Dataset):
    def __init__(self, vocab):
        self.vocab = vocab

    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(0, self.vocab, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def run(out, resume=None):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_path(), dtype=torch.bfloat16)
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    if resume is not None:
        with torch.no_grad():  # Weights the resume must replace.
            for p in model.parameters():
                p.mul_(0.5)
    opt = ckpt.torch.StagedAdamW(model.named_parameters(), lr=1e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        max_steps=6, save_steps=3, report_to=[], use_cpu=True, seed=0, data_seed=0,
        disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, optimizers=(opt, sched),
                                   train_dataset=Tokens(model.config.vocab_size))
    trainer.train(resume_from_checkpoint=resume)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, opt


def test_hf_trainer_resumes_bit_for_bit_with_staged_adamw(tmp_path):
    uninterrupted, opt = run(tmp_path / "a")
    assert sorted(os.listdir(tmp_path / "a")) == ["checkpoint-3", "checkpoint-6"]
    assert os.path.exists(tmp_path / "a" / "checkpoint-3" / "optimizer.pt")
    resumed, opt2 = run(tmp_path / "b", resume=str(tmp_path / "a" / "checkpoint-3"))
    for name, p in uninterrupted.items():
        assert resumed[name].dtype == torch.bfloat16
        assert torch.equal(resumed[name], p), name
    assert opt2.param_steps() == opt.param_steps() == [6] * len(opt.param_steps())
    for p, q in zip(opt._params, opt2._params):
        assert torch.equal(opt.master(p), opt2.master(q))


def small_data(samples=32):
    g = torch.Generator().manual_seed(1)
    return torch.randn(samples, 8, generator=g), torch.randn(samples, 1, generator=g)


def small_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))


def test_lightning_fit_checkpoints_and_resumes_bit_for_bit(tmp_path):
    L = pytest.importorskip("lightning")

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = small_net()

        def training_step(self, batch, index):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return ckpt.torch.StagedAdamW(self.parameters(), lr=1e-2)

    def fit(root, ckpt_path=None):
        module = Module()
        if ckpt_path is not None:
            with torch.no_grad():
                for p in module.parameters():
                    p.mul_(0.5)
        x, y = small_data()  # 4 steps an epoch: the checkpoint at step 4 ends an epoch.
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
        saver = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(root), every_n_train_steps=4,
                                                   save_top_k=-1)
        trainer = L.Trainer(max_steps=8, accelerator="cpu", logger=False, callbacks=[saver],
                            enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=str(tmp_path))
        trainer.fit(module, loader, ckpt_path=ckpt_path)
        return [p.detach().clone() for p in module.parameters()]

    uninterrupted = fit(tmp_path / "a")
    first = sorted(os.listdir(tmp_path / "a"))[0]
    assert first == "epoch=0-step=4.ckpt"
    resumed = fit(tmp_path / "b", ckpt_path=str(tmp_path / "a" / first))
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted, resumed))


def test_accelerate_prepare_save_state_and_save_model(tmp_path):
    accelerate = pytest.importorskip("accelerate")
    safetensors = pytest.importorskip("safetensors.torch")
    x, y = small_data(48)

    def train(acc, model, opt, steps):
        for s in steps:
            opt.zero_grad()
            batch = slice(8 * s, 8 * s + 8)
            acc.backward(torch.nn.functional.mse_loss(model(x[batch]), y[batch]))
            opt.step()

    acc = accelerate.Accelerator(cpu=True)
    model = small_net()
    model, opt = acc.prepare(model, ckpt.torch.StagedAdamW(model.parameters(), lr=1e-2))
    train(acc, model, opt, range(3))
    acc.save_state(str(tmp_path / "state"))
    train(acc, model, opt, range(3, 6))
    acc.save_model(model, str(tmp_path / "model"))
    saved = safetensors.load_file(str(tmp_path / "model" / "model.safetensors"))
    assert set(saved) == set(model.state_dict())  # Every tensor, each in its own storage.
    for name, t in model.state_dict().items():
        assert torch.equal(saved[name], t), name
    acc2 = accelerate.Accelerator(cpu=True)
    model2 = small_net()
    model2, opt2 = acc2.prepare(model2, ckpt.torch.StagedAdamW(model2.parameters(), lr=1e-2))
    with torch.no_grad():
        for p in model2.parameters():
            p.mul_(0.5)
    acc2.load_state(str(tmp_path / "state"))
    train(acc2, model2, opt2, range(3, 6))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


@pytest.mark.parametrize("given", ["trainable", "all"])
def test_peft_lora_equals_torch_adamw_with_a_frozen_bf16_base(given):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")

    def make(kind):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_pretrained(llama_path(),
                                                                  dtype=torch.bfloat16)
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
            init_lora_weights="gaussian"))
        params = [p for p in model.parameters() if given == "all" or p.requires_grad]
        if kind == "ckpt":
            return model, ckpt.torch.StagedAdamW(params, lr=1e-2)
        return model, torch.optim.AdamW(params, lr=1e-2, foreach=False)

    (ours, opt), (ref, ropt) = make("ckpt"), make("torch")
    # PEFT keeps the adapters in FP32 beside the BF16 base: one optimizer holds both dtypes.
    assert {p.dtype for p in ours.parameters() if p.requires_grad} == {torch.float32}
    assert {p.dtype for p in ours.parameters() if not p.requires_grad} == {torch.bfloat16}
    base = {n: p.detach().clone() for n, p in ours.named_parameters() if not p.requires_grad}
    for s in range(3):
        ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(s))
        for model, o in ((ours, opt), (ref, ropt)):
            o.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
            o.step()
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        if not p.requires_grad:
            assert torch.equal(p, base[name]), name  # The frozen base does not move.
            continue
        error = ((p.double() - q.double()).norm() / q.double().norm().clamp_min(1e-30)).item()
        assert error <= 2e-6, name


def test_dcp_get_state_dict_and_a_save_load_round_trip(tmp_path):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    sd = pytest.importorskip("torch.distributed.checkpoint.state_dict")
    x, y = small_data()

    def step(model, opt, s):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[s::4]), y[s::4]).backward()
        opt.step()

    model = small_net()
    opt = ckpt.torch.StagedAdamW(model.parameters(), lr=1e-2)
    for s in range(3):
        step(model, opt, s)
    before = opt.state_dict()
    model_sd, optim_sd = sd.get_state_dict(model, opt)
    after = opt.state_dict()
    for i, entry in before["state"].items():  # Nothing stepped, nothing changed.
        assert all(torch.equal(entry[k], after["state"][i][k]) for k in entry)
    assert set(optim_sd["state"]["0.weight"]) >= {"step", "exp_avg", "exp_avg_sq"}
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path / "dcp"))
    torch.manual_seed(5)
    model2 = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    opt2 = ckpt.torch.StagedAdamW(model2.parameters(), lr=1e-2)
    state = dict(zip(("model", "optim"), sd.get_state_dict(model2, opt2)))
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
    sd.set_state_dict(model2, opt2, model_state_dict=state["model"],
                      optim_state_dict=state["optim"])
    assert opt2.param_steps() == opt.param_steps() == [3] * 4
    for s in range(3, 5):
        step(model, opt, s)
        step(model2, opt2, s)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
