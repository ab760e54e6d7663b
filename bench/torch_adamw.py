#!/usr/bin/env python3
"""torch's fused CPU AdamW on one FP32 parameter of N elements: the baseline ckpt's CPU engine is
measured against (bench/adamw_vs_torch.sh). Prints one JSON line: the best of --steps steps in
parameters per second, for the step alone and for the step plus the BF16 model copy that
ckpt's step also writes (what a trainer keeping FP32 masters on the CPU has to do after it)."""
import argparse
import json
import os
import time

import torch

ap = argparse.ArgumentParser()
ap.add_argument("--params", type=int, required=True)
ap.add_argument("--threads", type=int, default=16)
ap.add_argument("--steps", type=int, default=4)
args = ap.parse_args()

torch.set_num_threads(args.threads)
n = args.params
p = torch.nn.Parameter(torch.zeros(n))
p.grad = torch.rand(n) * 2 - 1
model = torch.empty(n, dtype=torch.bfloat16)
opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
opt.step()  # Creates the moments and touches every page, as ckpt's warm-up step does.


def best(fn):
    t = float("inf")
    for _ in range(args.steps):
        start = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - start)
    return n / t / 1e9


def step_and_copy():
    opt.step()
    model.copy_(p.detach())


print(json.dumps({"torch": torch.__version__, "threads": args.threads, "params": n,
                  "huge_pages": os.environ.get("THP_MEM_ALLOC_ENABLE") == "1",
                  "step_gparams_per_s": best(opt.step),
                  "step_and_copy_gparams_per_s": best(step_and_copy)}))
