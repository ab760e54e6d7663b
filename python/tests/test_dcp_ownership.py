"""One save owns a ckpt.dcp.StorageWriter from its set-up to its commit (ckpt/_dcp_writer.py,
O1-O6): a first save is stopped at every point of the protocol (a hook, not sleeps) while a
second save, a reset to another store, async_save and close() are tried through the same writer;
each is refused by name, and the first save lands exactly where it was meant to. Then 200 runs of
two back-to-back async_saves through one writer, and saves that fail between DCP's phases
leave a writer that can be closed and used again. Needs torch's dcp.async_save."""
import os
import threading

import pytest
import torch

pytest.importorskip("torch.distributed.checkpoint.state_dict")
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner  # noqa: E402

import ckpt._dcp_writer  # noqa: E402
import ckpt.dcp  # noqa: E402

if not hasattr(dcp, "async_save"):
    pytest.skip("this torch has no dcp.async_save", allow_module_level=True)

REFUSED = (Exception, dcp.api.CheckpointException)
# Entered in this order by a save; "commit" is inside finish, with the claim active.
POINTS = ["reset", "set_up", "local_plan", "global_plan", "write_data", "finish", "commit"]


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setattr(ckpt._dcp_writer, "_ENDED_THREAD_WAIT_S", 0.05)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


class Stop:
    """A writer hook that holds the first save's thread (never the test's) at `point`."""

    def __init__(self, point):
        self.point, self.reached, self.go = point, threading.Event(), threading.Event()

    def __call__(self, point):
        if point == self.point and threading.current_thread() is not threading.main_thread():
            self.reached.set()
            assert self.go.wait(60)


def state(value):
    return {"w": torch.full((16, 8), float(value)), "n": torch.arange(5) * int(value)}


def stored(root, step):
    """The state step `step` of `root` holds (its "w" value), or None without that step."""
    if ckpt.dcp.latest_step(root) is None or \
            not os.path.isdir(os.path.join(root, f"step-{step:08d}")):
        return None
    got = state(0)
    dcp.load(got, storage_reader=ckpt.dcp.StorageReader(root, step=step))
    assert torch.equal(got["n"], torch.arange(5) * int(got["w"][0, 0].item()))
    return got["w"][0, 0].item()


def start(how, writer, value, checkpoint_id):
    """The first save, in another thread: returns a function that waits for its end and
    returns its error (None when it committed)."""
    if how == "async_save":
        pending = dcp.async_save(state(value), storage_writer=writer,
                                 checkpoint_id=checkpoint_id)
        pending = getattr(pending, "upload_completion", pending)

        def wait():
            try:
                pending.result(timeout=60)
            except BaseException as e:  # noqa: BLE001 (returned to the test)
                return e
            return None
        return wait
    errors = []

    def run():
        try:
            dcp.save(state(value), storage_writer=writer, checkpoint_id=checkpoint_id)
        except BaseException as e:  # noqa: BLE001 (returned to the test)
            errors.append(e)
    thread = threading.Thread(target=run)
    thread.start()

    def wait():
        thread.join(60)
        return errors[0] if errors else None
    return wait


@pytest.mark.parametrize("how", ["async_save", "save_in_a_thread"])
@pytest.mark.parametrize("point", POINTS)
def test_a_save_stopped_anywhere_owns_its_writer_and_lands_where_it_was_meant_to(
        tmp_path, how, point):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    writer = ckpt.dcp.StorageWriter()
    stop = writer._hook = Stop(point)
    wait = start(how, writer, 1, os.path.join(a, "step-1"))
    assert stop.reached.wait(60)
    # Before its thread's first call, a plain save in a thread has not claimed the writer
    # yet: the second save then goes first, to its own store. In every other case the first
    # save owns the writer and everything else is refused by name.
    owned = not (how == "save_in_a_thread" and point == "reset")
    try:
        second(writer, owned, b)
    finally:
        stop.go.set()
    assert wait() is None
    assert stored(a, 1) == 1.0
    assert stored(b, 9) == (None if owned else 2.0)
    assert not [n for n in os.listdir(a) if n.startswith(".staging")]
    # Once it committed, the writer serves the next save.
    writer._hook = None
    dcp.save(state(3), storage_writer=writer, checkpoint_id=os.path.join(b, "step-10"))
    assert stored(b, 10) == 3.0
    writer.close()


def second(writer, owned, b):
    """What is tried through `writer` while the first save is stopped."""
    writer.root, writer.step = b, 9  # Attributes written meanwhile redirect nothing.
    tries = [lambda: dcp.save(state(2), storage_writer=writer,
                              checkpoint_id=os.path.join(b, "step-9")),
             lambda: dcp.async_save(state(2), storage_writer=writer,
                                    checkpoint_id=os.path.join(b, "step-9")),
             lambda: writer.reset(os.path.join(b, "step-9")),
             writer.close]
    if owned:
        for attempt in tries:
            with pytest.raises(REFUSED, match=r"refused: (the save of step 1 to .*a|dcp.async_"
                                              r"save's save .*) through this writer has not "
                                              r"finished"):
                attempt()
    else:
        dcp.save(state(2), storage_writer=writer, checkpoint_id=os.path.join(b, "step-9"))


@pytest.mark.parametrize("stager", ["the_writer", "torch_default"])
def test_two_back_to_back_async_saves_through_one_writer_never_crash_or_misdirect(
        tmp_path, stager):
    kwargs = {}
    if stager == "torch_default":
        # The writer is then claimed in the saves' own threads, which race for it.
        import inspect
        if "async_stager" not in inspect.signature(dcp.async_save).parameters:
            pytest.skip("this torch's async_save takes no async_stager")
        from torch.distributed.checkpoint.staging import BlockingAsyncStager
        kwargs["async_stager"] = BlockingAsyncStager()
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    writer = ckpt.dcp.StorageWriter()
    landed = {a: {}, b: {}}
    refused = 0
    for i in range(1, 201):
        waits = []
        for root, value in ((a, i), (b, -i)):
            try:
                pending = dcp.async_save(state(value), storage_writer=writer,
                                         checkpoint_id=os.path.join(root, f"step-{i}"), **kwargs)
            except REFUSED as e:
                assert "has not finished" in str(e), str(e)
                refused += 1
                continue
            pending = getattr(pending, "upload_completion", pending)
            waits.append((root, value, pending))
        for root, value, pending in waits:
            try:
                pending.result(timeout=60)
                landed[root][i] = value
            except REFUSED as e:
                assert "has not finished" in str(e), str(e)
                refused += 1
    assert refused >= (200 if stager == "the_writer" else 1)
    # Every save that reported success is in its own store, under its own step, with its own
    # data; nothing else was published anywhere.
    for root, steps in landed.items():
        if not steps:
            assert ckpt.dcp.latest_step(root) is None
            continue
        committed = sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("step-"))
        assert committed == sorted(steps)
        for i in (min(steps), max(steps), sorted(steps)[len(steps) // 2]):
            assert stored(root, i) == float(steps[i])
    assert landed[a], "the first save of each pair never committed"
    writer.close()


class _FailsAfterTheStepBegan(DefaultSavePlanner):
    """Raises in DCP's own code between the writer's prepare_global_plan (the step begun, the
    store held) and its write_data."""

    def finish_plan(self, central_plan):
        raise RuntimeError("planner failed")


@pytest.mark.parametrize("how", ["save", "async_save"])
def test_a_save_that_failed_between_phases_leaves_a_writer_that_closes_and_saves_again(
        tmp_path, how):
    root = str(tmp_path / "root")
    writer = ckpt.dcp.StorageWriter()
    target = os.path.join(root, "step-1")
    with pytest.raises(REFUSED, match="planner failed"):
        if how == "save":
            dcp.save(state(1), storage_writer=writer, checkpoint_id=target,
                     planner=_FailsAfterTheStepBegan())
        else:
            pending = dcp.async_save(state(1), storage_writer=writer, checkpoint_id=target,
                                     planner=_FailsAfterTheStepBegan())
            getattr(pending, "upload_completion", pending).result(timeout=60)
    if how == "save":
        # The same thread's next save abandons the failed one (its staging goes) and commits.
        dcp.save(state(2), storage_writer=writer, checkpoint_id=os.path.join(root, "step-2"))
        assert stored(root, 2) == 2.0
    else:
        # Its thread is gone: close() lets go of the store, and another writer saves there.
        writer.close()
        dcp.save(state(2), storage_writer=ckpt.dcp.StorageWriter(root, step=2))
        assert stored(root, 2) == 2.0
    assert stored(root, 1) is None
    assert not [n for n in os.listdir(root) if n.startswith(".staging")]
    writer.close()


@pytest.mark.parametrize("checkpoint_id", ["bytes", 7])
def test_an_async_save_that_fails_before_naming_its_checkpoint_frees_the_writer(
        tmp_path, checkpoint_id):
    # Its thread's reset() raised before adopting the reservation stage() made: the writer was
    # refused to everything since (found by a probe).
    if checkpoint_id == "bytes":
        checkpoint_id = os.fsencode(str(tmp_path / "a" / "step-1"))
    writer = ckpt.dcp.StorageWriter()
    pending = dcp.async_save(state(1), storage_writer=writer, checkpoint_id=checkpoint_id)
    with pytest.raises(REFUSED):
        getattr(pending, "upload_completion", pending).result(timeout=60)
    dcp.save(state(2), storage_writer=writer, checkpoint_id=str(tmp_path / "b" / "step-2"))
    assert stored(str(tmp_path / "b"), 2) == 2.0
    writer.close()


def test_an_async_saves_thread_never_changes_where_the_callers_next_save_goes(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    writer = ckpt.dcp.StorageWriter(a, step=1)
    dcp.save(state(1), storage_writer=writer)
    # The async save's thread is late to reset(); the caller points the writer at a, step 2
    # meanwhile, for its next save (which names no checkpoint_id).
    stop = writer._hook = Stop("reset")
    pending = dcp.async_save(state(5), storage_writer=writer,
                             checkpoint_id=os.path.join(b, "step-5"),
                             planner=_FailsAfterTheStepBegan())
    writer.root, writer.step = a, 2
    stop.go.set()
    with pytest.raises(REFUSED, match="planner failed"):
        getattr(pending, "upload_completion", pending).result(timeout=60)
    writer._hook = None
    assert (writer.root, writer.step) == (a, 2)
    dcp.save(state(2), storage_writer=writer)
    assert stored(a, 2) == 2.0
    assert ckpt.dcp.latest_step(b) is None
    writer.close()
