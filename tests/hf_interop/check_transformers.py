#!/usr/bin/env python3
"""Checks that checkpoints written by ckpt's safetensors writer load in the Python ecosystem.

Needs torch, safetensors and transformers (not part of ctest; run on a machine that has them):

    python3 tests/hf_interop/check_transformers.py --tool build/cli/ckpt-tool \
        --testdata ../shared/testdata/hf_tiny_models --work /tmp/hf-interop \
        [--demo-trainer build/demo/ckpt-demo-trainer]

1. Each transformers-written tiny model is rewritten by `ckpt-tool hf-reshard`, once as one file
   and once sharded; every tensor loaded with safetensors.torch.load_file must equal the original
   bit for bit, and AutoModelForCausalLM.from_pretrained must load the sharded export with the
   same state dict and the same logits as the original.
2. A file with one tensor of each torch dtype safetensors supports, written by
   safetensors.torch.save_file, goes through hf-reshard and must load back bit-exactly.
3. With --demo-trainer: each tiny model is trained by the demo trainer, killed mid-save and
   resumed; its export (optimizer::ExportHf, behind ckpt-tool export-hf) must load with
   from_pretrained holding exactly the exported bits; so must `ckpt-tool export-hf` of its
   store, sharded with the config copied, as BF16 weights and as the FP32 masters.
"""
import argparse
import glob
import os
import shutil
import subprocess
import sys

import torch
from safetensors.torch import load_file, save_file


def load_dir(path):
    tensors = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        tensors.update(load_file(f))
    return tensors


def same_bits(a, b):
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def reshard(tool, src, dst, max_shard=None):
    shutil.rmtree(dst, ignore_errors=True)
    cmd = [tool, "hf-reshard", src, dst]
    if max_shard:
        cmd += ["--max-shard-size", max_shard]
    subprocess.run(cmd, check=True)


def check_models(tool, testdata, work):
    from transformers import AutoModelForCausalLM
    ok = True
    for model in sorted(os.listdir(testdata)):
        src = os.path.join(testdata, model)
        original = load_dir(src)
        for layout, max_shard in (("single", None), ("sharded", "100K")):
            dst = os.path.join(work, f"{model}-{layout}")
            reshard(tool, src, dst, max_shard)
            for extra in ("config.json", "generation_config.json"):
                if os.path.exists(os.path.join(src, extra)):
                    shutil.copy(os.path.join(src, extra), dst)
            ours = load_dir(dst)
            files = len(glob.glob(os.path.join(dst, "*.safetensors")))
            exact = ours.keys() == original.keys() and all(same_bits(ours[k], original[k]) for k in original)
            print(f"{model} {layout}: {files} file(s), {len(ours)} tensors, load_file bit-exact: {exact}")
            ok &= exact
            if layout == "sharded":
                a = AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.bfloat16)
                b = AutoModelForCausalLM.from_pretrained(dst, torch_dtype=torch.bfloat16)
                sa, sb = a.state_dict(), b.state_dict()
                same_state = sa.keys() == sb.keys() and all(same_bits(sa[k], sb[k]) for k in sa)
                ids = torch.arange(1, 17).unsqueeze(0) % a.config.vocab_size
                with torch.no_grad():
                    same_logits = torch.equal(a(ids).logits, b(ids).logits)
                print(f"{model} sharded: from_pretrained state dict equal: {same_state}, logits equal: {same_logits}")
                ok &= same_state and same_logits
    return ok


def check_dtypes(tool, work):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 5, generator=g),
        "f16": torch.randn(7, generator=g).half(),
        "bf16": torch.randn(2, 3, 4, generator=g).bfloat16(),
        "f64": torch.randn(4, generator=g).double(),
        "i64": torch.arange(-5, 5, dtype=torch.int64),
        "i32": torch.arange(6, dtype=torch.int32).reshape(2, 3),
        "i16": torch.arange(-3, 3, dtype=torch.int16),
        "i8": torch.arange(-4, 4, dtype=torch.int8),
        "u8": torch.arange(0, 250, 10, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "f8_e4m3": torch.randn(8, generator=g).to(torch.float8_e4m3fn),
        "f8_e5m2": torch.randn(8, generator=g).to(torch.float8_e5m2),
    }
    src = os.path.join(work, "dtypes.safetensors")
    save_file(tensors, src, metadata={"format": "pt"})
    dst = os.path.join(work, "dtypes-ckpt")
    reshard(tool, src, dst)
    back = load_file(os.path.join(dst, "model.safetensors"))
    exact = back.keys() == tensors.keys() and all(same_bits(back[k], tensors[k]) for k in tensors)
    print(f"dtypes ({', '.join(sorted(tensors))}): load_file bit-exact: {exact}")
    return exact


def check_demo_trainer(tool, trainer, testdata, work):
    """The demo trainer's export of each tiny model (after a crash and a resume) loads with
    from_pretrained, holds exactly the exported bits, has changed, and gives finite logits."""
    from transformers import AutoModelForCausalLM
    ok = True
    for model in sorted(os.listdir(testdata)):
        src = os.path.join(testdata, model)
        out = os.path.join(work, f"demo-{model}")
        shutil.rmtree(out, ignore_errors=True)
        common = [trainer, "--out", out, "--model", src, "--ranks", "3", "--steps", "6",
                  "--save-every", "2"]
        crashed = subprocess.run(common + ["--crash-at", "5"], capture_output=True)
        resumed = subprocess.run(common + ["--resume"], capture_output=True, text=True)
        equal = crashed.returncode == -9 and resumed.returncode == 0 and \
            "equals an uninterrupted one bit for bit" in resumed.stdout
        final = os.path.join(out, "final-model")
        exported = load_dir(final)
        original = load_dir(src)
        m = AutoModelForCausalLM.from_pretrained(final, torch_dtype=torch.bfloat16)
        sd = m.state_dict()
        # Compare by name what transformers keeps by name: it fills a tied lm_head from
        # embed_tokens, and transformers 5 fuses MoE experts' per-expert tensors into one.
        common = [k for k in exported if k in sd]
        same = len(common) > 0 and all(same_bits(sd[k], exported[k]) for k in common)
        converted = len(exported) - len(common)
        trained = any(not same_bits(exported[k], original[k].to(torch.bfloat16)) for k in exported)
        ids = torch.arange(1, 17).unsqueeze(0) % m.config.vocab_size
        with torch.no_grad():
            finite = bool(torch.isfinite(m(ids).logits).all())
        print(f"demo {model}: killed and resumed bit-exact: {equal}, from_pretrained holds the "
              f"export: {same} ({len(common)} tensors by name, {converted} converted), weights "
              f"changed: {trained}, logits finite: {finite}")
        ok &= equal and same and trained and finite
        # ckpt-tool export-hf of the demo's store: sharded, config copied; weights and masters.
        for source, dtype, torch_dtype in (("weights", "BF16", torch.bfloat16),
                                           ("masters", "F32", torch.float32)):
            cli = os.path.join(out, f"export-{source}")
            shutil.rmtree(cli, ignore_errors=True)
            subprocess.run([tool, "export-hf", os.path.join(out, "store"), cli, "--from", source,
                            "--dtype", dtype, "--max-shard-size", "100K", "--config",
                            os.path.join(src, "config.json")], check=True, capture_output=True)
            files = len(glob.glob(os.path.join(cli, "*.safetensors")))
            ours = load_dir(cli)
            m = AutoModelForCausalLM.from_pretrained(cli, torch_dtype=torch_dtype)
            sd = m.state_dict()
            by_name = [k for k in ours if k in sd]
            holds = len(by_name) > 0 and all(same_bits(sd[k], ours[k]) for k in by_name)
            # The masters rounded to BF16 are the weights the demo exported.
            rounds = all(same_bits(ours[k].to(torch.bfloat16), exported[k]) for k in exported) \
                if source == "masters" else ours.keys() == exported.keys() and \
                all(same_bits(ours[k], exported[k]) for k in exported)
            print(f"demo {model}: export-hf --from {source} --dtype {dtype}: {files} file(s), "
                  f"from_pretrained holds the export: {holds} ({len(by_name)} tensors by name), "
                  f"{'rounds to' if source == 'masters' else 'equals'} the demo's export: {rounds}")
            ok &= holds and rounds and files > 1
    return ok


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tool", required=True)
    p.add_argument("--testdata", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--demo-trainer", help="ckpt-demo-trainer: also check its exports")
    args = p.parse_args()
    os.makedirs(args.work, exist_ok=True)
    import safetensors
    import transformers
    print(f"torch {torch.__version__}, safetensors {safetensors.__version__}, transformers {transformers.__version__}")
    ok = check_dtypes(args.tool, args.work)
    ok &= check_models(args.tool, args.testdata, args.work)
    if args.demo_trainer:
        ok &= check_demo_trainer(args.tool, args.demo_trainer, args.testdata, args.work)
    print("ALL OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
