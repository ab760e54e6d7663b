"""One rank of the DCP storage tests (test_dcp_storage.py): DTensors sharded over gloo, saved
and loaded through ckpt.dcp. Usage:
    dcp_worker.py RANK WORLD INIT_FILE ROOT (save STEP | fail STEP | load | kill STEP |
                                             nocoll STEP)
save: rows Shard(0), cols and wide Shard(1) (chunks that are not ranges of the flat index), a
replicated tensor and a Python value, as step STEP. fail: as save, but rank 1's writes raise
after its first tensor. load: every tensor as Shard(0) at this world size (wide as Shard(1)),
each rank's shard checked against the full tensors. kill: as save, but rank 1 is SIGKILLed after its first tensor
(rank 0 then sees the job fail). nocoll: dcp.save(use_collectives=False), which every
rank must refuse."""
import datetime
import inspect
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

import ckpt.dcp


def full():
    g = torch.Generator().manual_seed(3)
    return {"rows": torch.randn(9, 5, generator=g),
            "cols": torch.randn(4, 7, generator=g).bfloat16(),
            "rep": torch.arange(6, dtype=torch.int64) * 7,
            "wide": torch.randn(100, 12, generator=g)}


def main():
    rank, world, init, root, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], \
        sys.argv[4], sys.argv[5]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (world,))
    want = full()
    if mode == "nocoll" and "use_collectives" not in inspect.signature(dcp.save).parameters:
        print("REFUSED WITHOUT COLLECTIVES (this torch's dcp.save always uses them)")
    elif mode == "nocoll":
        # Each rank would save its chunks alone as the whole step: refused on every rank.
        state = {"rows": distribute_tensor(want["rows"], mesh, [Shard(0)])}
        try:
            dcp.save(state, storage_writer=ckpt.dcp.StorageWriter(root, step=int(sys.argv[6])),
                     use_collectives=False)
        except (Exception, dcp.api.CheckpointException) as e:
            assert "needs DCP's collectives" in str(e), str(e)
            print("REFUSED WITHOUT COLLECTIVES")
    elif mode in ("save", "fail", "kill"):
        step = int(sys.argv[6])
        state = {"model": {"rows": distribute_tensor(want["rows"], mesh, [Shard(0)]),
                           "cols": distribute_tensor(want["cols"], mesh, [Shard(1)]),
                           "rep": want["rep"].clone(),
                           "wide": distribute_tensor(want["wide"], mesh, [Shard(1)])},
                 "note": {"text": "saved at world", "world": world}}
        if mode != "save" and rank == 1:
            write_items = ckpt._dcp_writer._write_items

            def stop_after_one(save, items, planner, results):
                tensors = [i for i in items if i.tensor_data is not None]
                write_items(save, tensors[:1], planner, results)
                if mode == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise OSError("injected: the disk went away")
            ckpt._dcp_writer._write_items = stop_after_one
        try:
            dcp.save(state, storage_writer=ckpt.dcp.StorageWriter(root, step=step))
        except (Exception, dcp.api.CheckpointException) as e:  # DCP's is a BaseException.
            if mode == "save":
                raise
            print("refused:", e)
            assert "injected: the disk went away" in str(e), str(e)
            assert "DCP rank 1" in str(e), str(e)
            print("FAILED AS INJECTED")
    else:
        # "wide" by columns again, at another world size: boxes of 100 short runs each.
        dims = {name: 1 if name == "wide" else 0 for name in want}
        state = {"model": {name: distribute_tensor(torch.zeros_like(t), mesh, [Shard(dims[name])])
                           for name, t in want.items()},
                 "note": {"text": "", "world": 0}}
        dcp.load(state, storage_reader=ckpt.dcp.StorageReader(root))
        for name, t in want.items():
            got = state["model"][name]
            n = t.shape[dims[name]]
            per = (n + world - 1) // world
            mine = t.narrow(dims[name], min(n, rank * per), max(0, min(n, (rank + 1) * per) -
                                                                 min(n, rank * per)))
            assert torch.equal(got.to_local(), mine), name
        assert state["note"]["text"] == "saved at world", state["note"]
        print("LOADED", state["note"]["world"])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
