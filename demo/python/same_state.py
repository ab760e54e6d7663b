#!/usr/bin/env python3
"""Compares two --dump files of train_gpt.py bit for bit: parameters, masters, both moments, the
LR scheduler's state, the RNG state and every group's step. Exit 0 when equal, 1 otherwise."""
import sys

import torch


def bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def main(a_path, b_path):
    a, b = torch.load(a_path, map_location="cpu"), torch.load(b_path, map_location="cpu")
    differ = []
    for kind in ("params", "masters", "exp_avg", "exp_avg_sq"):
        for name in b[kind]:
            if name not in a[kind] or not torch.equal(bits(a[kind][name]), bits(b[kind][name])):
                differ.append(f"{kind} {name}")
    if a["sched"] != b["sched"]:
        differ.append("LR scheduler state")
    if not torch.equal(a["rng"], b["rng"]):
        differ.append("RNG state")
    if a["group_steps"] != b["group_steps"]:
        differ.append("group steps")
    if differ:
        print("resumed run DIFFERS from an uninterrupted one: " + ", ".join(differ[:10]))
        return 1
    print(f"resumed run equals an uninterrupted one bit for bit ({len(b['params'])} parameters "
          "with their masters and moments, the LR scheduler, the RNG, the group steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
