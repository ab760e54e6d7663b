"""torch.distributed.checkpoint saving and loading the same state through DCP's own
FileSystemWriter/FileSystemReader and through ckpt's storage layer (ckpt.dcp), against the
O_DIRECT write and read bounds of the same disk measured in the same run (`ckpt-tool bench io`,
before and after the rounds).

    CKPT_LIB=build/capi/libckpt_c.so PYTHONPATH=python \\
        python bench/dcp_storage.py --dir /fast/disk [--size 4G] [--tensors 64] [--rounds 2]

The state is --tensors FP32 tensors of --size bytes in all (on --device: cpu, or cuda). Each
round runs both systems, who goes first alternating, each on a fresh directory: a timed
dcp.save (durable: DCP's writer fsyncs every file, ckpt's commit syncs its data and MANIFEST),
then a timed dcp.load into preallocated tensors, after the saved files were dropped from the
page cache (posix_fadvise DONTNEED), so that both loads read the disk. It prints each round, the
best of each system, the bounds, and the ratios ckpt/bound and ckpt/DCP. Goal: ckpt's save and
load >= 0.9 of the bound and ahead of DCP's own.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import ckpt.dcp  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    text = text.strip().upper().rstrip("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def drop_cache(path):
    """Drops every file under `path` from the page cache (clean pages only: both writers synced
    them), so that a load reads the disk."""
    for dirpath, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def bounds(tool, directory, size):
    out = subprocess.run([tool, "bench", "io", "--dir", directory, "--size", str(size), "--json"],
                         check=True, capture_output=True, text=True).stdout
    got = json.loads(out)
    return got["write_bound_gbps"], got["read_bound_gbps"]


def run(system, state, directory, dcp_threads):
    if os.path.exists(directory):
        shutil.rmtree(directory)
    os.makedirs(directory)
    if system == "dcp":
        writer = dcp.FileSystemWriter(directory, thread_count=dcp_threads)
        reader = dcp.FileSystemReader(directory)
    else:
        writer = ckpt.dcp.StorageWriter(directory, step=1)
        reader = ckpt.dcp.StorageReader(directory)
    sync()
    start = time.perf_counter()
    dcp.save(state, storage_writer=writer)
    saved = time.perf_counter() - start
    drop_cache(directory)
    target = {name: torch.empty_like(t) for name, t in state.items()}
    sync()
    start = time.perf_counter()
    dcp.load(target, storage_reader=reader)
    sync()
    loaded = time.perf_counter() - start
    for name, t in state.items():
        if not torch.equal(target[name], t):
            raise SystemExit(f"{system}: tensor {name} did not load back equal")
    shutil.rmtree(directory)
    return saved, loaded


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--size", default="4G")
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dcp-threads", type=int, default=1,
                        help="FileSystemWriter's thread_count (DCP's default: 1)")
    parser.add_argument("--tool", default=os.environ.get("CKPT_TOOL") or
                        os.path.join(REPO, "build", "cli", "ckpt-tool"))
    args = parser.parse_args()
    size = parse_size(args.size)
    per = size // args.tensors // 4
    gen = torch.Generator().manual_seed(0)
    state = {f"layers.{i}.weight": torch.randn(per, generator=gen).to(args.device)
             for i in range(args.tensors)}
    total = per * 4 * args.tensors
    gb = total / 1e9
    print(f"state {total / (1 << 30):.2f} GiB in {args.tensors} FP32 tensors on {args.device}, "
          f"torch {torch.__version__}, DCP FileSystemWriter thread_count={args.dcp_threads}")
    write_bound, read_bound = bounds(args.tool, args.dir, total)
    best = {"dcp": [float("inf")] * 2, "ckpt": [float("inf")] * 2}
    for r in range(args.rounds):
        order = ["dcp", "ckpt"] if r % 2 == 0 else ["ckpt", "dcp"]
        for system in order:
            times = run(system, state, os.path.join(args.dir, f"dcp-bench-{system}"),
                        args.dcp_threads)
            best[system] = [min(a, b) for a, b in zip(best[system], times)]
            print(f"round {r + 1} {system:4s}  save {gb / times[0]:6.2f} GB/s   "
                  f"load {gb / times[1]:6.2f} GB/s")
    w2, r2 = bounds(args.tool, args.dir, total)
    write_bound, read_bound = max(write_bound, w2), max(read_bound, r2)
    print(f"O_DIRECT bound   write {write_bound:6.2f} GB/s   read {read_bound:6.2f} GB/s "
          f"(ckpt-tool bench io, best of before and after)")
    for system in ("dcp", "ckpt"):
        save_rate, load_rate = gb / best[system][0], gb / best[system][1]
        print(f"{system:4s} best   save {save_rate:6.2f} GB/s ({save_rate / write_bound:.2f} of "
              f"bound)   load {load_rate:6.2f} GB/s ({load_rate / read_bound:.2f} of bound)")
    print(f"ckpt/DCP   save {best['dcp'][0] / best['ckpt'][0]:.2f}x   "
          f"load {best['dcp'][1] / best['ckpt'][1]:.2f}x")


if __name__ == "__main__":
    main()
