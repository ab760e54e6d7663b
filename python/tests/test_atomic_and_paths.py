"""Ctrl-C at every line of a call, read-only checkpointers, NUL bytes in paths, extra's limit.

The interrupt tests run a call under sys.settrace and send SIGINT to this thread at the k-th
line the ckpt package executes, for k = 0, 1, 2, ... until a run ends before line k. Each run
must end in one of the call's two states (nothing done, or all of it done, KeyboardInterrupt or
not), never in a mix. The load and save_async loops also run with the critical sections
switched off and must then find a mix: they can fail.
"""
import contextlib
import ctypes
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import ckpt
import ckpt.torch
from ckpt import _lib, _signals

PACKAGE = os.path.dirname(os.path.abspath(ckpt.__file__)) + os.sep
MAX_LINES = 400
HERE = os.path.dirname(os.path.abspath(__file__))


def tiny(seed, lr=1e-3):
    """Two parameters in two groups: a small optimizer that is quick to build many times."""
    torch.manual_seed(seed)
    w, b = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(4))
    opt = ckpt.torch.StagedAdamW([{"params": [("w", w)], "weight_decay": 0.1},
                                  {"params": [("b", b)], "weight_decay": 0.0}], lr=lr,
                                 threads=1)
    return (w, b), opt


def train(params, opt, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()


def state(params, opt):
    """What a load applies and a save records: weights, masters, moments, hyper-parameters."""
    return {"tensors": [t for p in params for t in (p.detach().clone(), opt.master(p),
                                                     opt.exp_avg(p), opt.exp_avg_sq(p))],
            "groups": [(g["lr"], g["betas"], g["eps"], g["weight_decay"])
                       for g in opt.param_groups],
            "steps": opt.group_steps(), "lifecycle": opt.lifecycle}


def same(a, b):
    return (len(a["tensors"]) == len(b["tensors"]) and
            all(torch.equal(x, y) for x, y in zip(a["tensors"], b["tensors"])) and
            all(a[k] == b[k] for k in ("groups", "steps", "lifecycle")))


class Interrupter:
    """Runs a call with SIGINT sent to this thread at its k-th line in the ckpt package.
    `lines` counts the package's lines so far (wrappers of C functions read it)."""

    def __init__(self, k):
        self.k, self.lines, self.sent, self.delivered_at = k, 0, False, None

    def _local(self, frame, event, arg):
        if event == "line":
            if self.lines == self.k and not self.sent:
                self.sent = True
                # Thread-directed: the handler runs before pthread_kill returns, i.e. at this
                # line (a KeyboardInterrupt raised here leaves the tracer, and sys unsets it).
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            self.lines += 1
        elif (event == "exception" and issubclass(arg[0], KeyboardInterrupt) and
              self.delivered_at is None):
            self.delivered_at = self.lines  # A deferred interrupt, raised by the section.
        return self._local

    def _global(self, frame, event, arg):
        if frame.f_code.co_filename.startswith(PACKAGE):
            return self._local(frame, event, arg)
        return None

    def run(self, call):
        """(result, KeyboardInterrupt or None). The cycle collector is off meanwhile: no
        finalizer of an earlier run's objects may run (and count lines) in this one."""
        result = interrupt = None
        collecting = gc.isenabled()
        gc.disable()
        sys.settrace(self._global)
        try:
            result = call()
        except KeyboardInterrupt as e:
            interrupt = e
        finally:
            sys.settrace(None)
            if collecting:
                gc.enable()
        return result, interrupt


@pytest.fixture(autouse=True)
def plain_sigint():
    """KeyboardInterrupt on SIGINT, as in a trainer, whatever the runner installed."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


@pytest.fixture
def calls(monkeypatch):
    """Wraps C functions so a test sees each call: calls.log[name] lists (handle, lines at
    return); calls.made[name] the handles made through an out-parameter."""

    class Calls:
        def __init__(self):
            self.log, self.made, self.interrupter = {}, {}, None

        def wrap(self, name, out=False):
            real = getattr(_lib.lib, name)
            self.log[name], self.made[name] = [], []

            def wrapper(*args):
                code = real(*args)
                handle = args[0].value if isinstance(args[0], ctypes.c_void_p) else args[0]
                lines = self.interrupter.lines if self.interrupter else None
                self.log[name].append((handle, lines))
                if out and code == 0:
                    self.made[name].append(args[-1]._obj.value)
                return code

            monkeypatch.setattr(_lib.lib, name, wrapper)

    return Calls()


def every_line(run_one):
    """run_one(Interrupter) for k = 0, 1, ... until a run ends before its k-th line; returns
    how many runs raised KeyboardInterrupt."""
    interrupted = 0
    for k in range(MAX_LINES):
        it = Interrupter(k)
        interrupted += run_one(it)
        if not it.sent:
            return interrupted
    pytest.fail(f"the call still ran past {MAX_LINES} lines of the package")


def load_outcome(root, saved, extra, calls, k):
    """One interrupted load into a fresh optimizer: 'before', 'after' (interrupted, nothing or
    all applied), 'done' (not interrupted) or 'mixed'."""
    params, opt = tiny(seed=1)
    ck = ckpt.Checkpointer(root, opt)
    before = state(params, opt)
    calls.log["ckpt_checkpointer_load"].clear()
    it = Interrupter(k)
    calls.interrupter = it
    result, interrupt = it.run(lambda: ck.load(2))
    calls.interrupter = None
    now = state(params, opt)
    loaded = len(calls.log["ckpt_checkpointer_load"]) == 1
    all_applied = (same(now, saved) and ck.loaded_step == 2 and ck.loaded_extra == extra and
                   (interrupt is not None or result == extra))
    if interrupt is None:
        outcome = "done" if loaded and all_applied else "mixed"
    elif not loaded:
        nothing = same(now, before) and ck.loaded_step is None and ck.loaded_extra is None
        outcome = "before" if nothing else "mixed"
    else:
        outcome = "after" if all_applied else "mixed"
    train(params, opt, seed=99)  # Either way the optimizer steps on.
    ck.close()
    opt.close()
    return outcome, it.sent


@pytest.fixture
def saved_root(tmp_path):
    """A root whose step 2 has learning rates and weights a fresh tiny(seed=1) does not."""
    params, opt = tiny(seed=0)
    ck = ckpt.Checkpointer(tmp_path / "root", opt)
    train(params, opt, seed=1)
    train(params, opt, seed=2)
    opt.param_groups[0]["lr"], opt.param_groups[1]["lr"] = 5e-4, 2e-4
    extra = {"data_position": 2, "note": "step two"}
    ck.save(2, extra=extra)
    saved = state(params, opt)
    ck.close()
    opt.close()
    return tmp_path / "root", saved, extra


def test_sigint_at_every_line_of_load_applies_all_or_nothing(saved_root, calls):
    root, saved, extra = saved_root
    calls.wrap("ckpt_checkpointer_load")
    seen = {"before": 0, "after": 0, "done": 0, "mixed": 0}
    for k in range(MAX_LINES):
        outcome, sent = load_outcome(root, saved, extra, calls, k)
        seen[outcome] += 1
        assert outcome != "mixed", f"SIGINT at line {k} of load left a mix"
        if not sent:
            break
    else:
        pytest.fail(f"load still ran past {MAX_LINES} lines")
    # Interrupts landed before the C call (nothing applied) and were deferred past it.
    assert seen["before"] > 0 and seen["after"] > 0 and seen["done"] == 1, seen


def test_without_critical_sections_an_interrupted_load_leaves_a_mix(saved_root, calls,
                                                                    monkeypatch):
    # Proves the loop above can fail: with the sections off, some line splits the load.
    monkeypatch.setattr(_signals, "deferred", contextlib.nullcontext)
    root, saved, extra = saved_root
    calls.wrap("ckpt_checkpointer_load")
    for k in range(MAX_LINES):
        outcome, sent = load_outcome(root, saved, extra, calls, k)
        if outcome == "mixed" or not sent:
            break
    assert outcome == "mixed"


def latest_on_disk(root, reader):
    """LATEST as a fresh read-only handle sees it."""
    ck = ckpt.Checkpointer(root, reader, read_only=True)
    try:
        return ck.latest
    finally:
        ck.close()


def test_sigint_at_every_line_of_save_comes_before_the_save_or_after_its_commit(tmp_path,
                                                                               calls):
    root = tmp_path / "root"
    params, opt = tiny(seed=0)
    reader_params, reader = tiny(seed=5)
    ck = ckpt.Checkpointer(root, opt)
    ck.save(1)
    calls.wrap("ckpt_checkpointer_save")
    committed, counts = {}, {"before": 0, "after": 0}

    def run_one(it):
        step = it.k + 2
        train(params, opt, seed=it.k)
        opt.param_groups[0]["lr"] = 1e-4 * (it.k + 1)  # Saved as it is at the call.
        snap, old = state(params, opt), ck.latest
        calls.log["ckpt_checkpointer_save"].clear()
        calls.interrupter = it
        _, interrupt = it.run(lambda: ck.save(step, extra={"k": it.k}))
        calls.interrupter = None
        log = calls.log["ckpt_checkpointer_save"]
        assert ck.latest == latest_on_disk(root, reader)
        assert same(state(params, opt), snap)  # A save changes nothing in the optimizer.
        assert ck.pending is None
        if log:
            assert ck.latest == step
            committed[step] = (snap, it.k)
            if interrupt is not None:  # Raised only once the C call had returned.
                counts["after"] += 1
                raised_at = it.delivered_at if it.delivered_at is not None else it.k
                assert raised_at >= log[0][1]
        else:
            assert interrupt is not None and ck.latest == old
            counts["before"] += 1
        return interrupt is not None

    assert every_line(run_one) == counts["before"] + counts["after"]
    assert counts["before"] > 0 and counts["after"] > 0, counts
    ck.close()
    # Every committed step holds the state and extra of its call.
    ck = ckpt.Checkpointer(root, reader)
    for step, (snap, k) in committed.items():
        assert ck.load(step) == {"k": k}
        assert same(state(reader_params, reader), snap), step
    ck.close()


def async_outcome(ck, params, opt, reader, root, calls, it, created):
    """One interrupted save_async: checks the handle's bookkeeping and finalizes it."""
    step = it.k + 2
    train(params, opt, seed=it.k)
    old = ck.latest
    made = calls.made["ckpt_checkpointer_save_async"]
    made.clear()
    result, interrupt = it.run(lambda: ck.save_async(step))
    if not made:
        assert interrupt is not None and ck.pending is None
        assert ck.latest == old == latest_on_disk(root, reader)
        return "before"
    created.extend(made)
    pending = result if interrupt is None else ck.pending
    if pending is None or pending._native._handle is None or pending._native._handle.value != made[0]:
        return "leaked"
    assert ck.pending is pending
    pending.finalize()  # After an interrupt too: the save is there to commit.
    assert ck.pending is None and ck.latest == step == latest_on_disk(root, reader)
    return "done" if interrupt is None else "after"


def test_sigint_at_every_line_of_save_async_keeps_its_handle(tmp_path, calls):
    root = tmp_path / "root"
    params, opt = tiny(seed=0)
    _, reader = tiny(seed=5)
    ck = ckpt.Checkpointer(root, opt)
    ck.save(1)
    calls.wrap("ckpt_checkpointer_save_async", out=True)
    calls.wrap("ckpt_pending_save_finalize")
    calls.wrap("ckpt_pending_save_destroy")
    created, seen = [], {"before": 0, "after": 0, "done": 0}

    def run_one(it):
        outcome = async_outcome(ck, params, opt, reader, root, calls, it, created)
        assert outcome != "leaked", f"SIGINT at line {it.k} lost the async save's handle"
        seen[outcome] += 1
        return outcome in ("before", "after")

    every_line(run_one)
    assert seen["before"] > 0 and seen["after"] > 0 and seen["done"] == 1, seen
    # Each native handle was finalized and destroyed exactly once.
    for name in ("ckpt_pending_save_finalize", "ckpt_pending_save_destroy"):
        assert sorted(h for h, _ in calls.log[name]) == sorted(created), name
    ck.close()


def test_without_critical_sections_an_interrupted_save_async_loses_its_handle(tmp_path, calls,
                                                                              monkeypatch):
    monkeypatch.setattr(_signals, "deferred", contextlib.nullcontext)
    root = tmp_path / "root"
    params, opt = tiny(seed=0)
    _, reader = tiny(seed=5)
    ck = ckpt.Checkpointer(root, opt)
    ck.save(1)
    calls.wrap("ckpt_checkpointer_save_async", out=True)
    outcome = None
    for k in range(MAX_LINES):
        it = Interrupter(k)
        outcome = async_outcome(ck, params, opt, reader, root, calls, it, [])
        if outcome == "leaked" or not it.sent:
            break
    assert outcome == "leaked"
    ck.close()


def test_sigint_at_every_line_of_finalize_finalizes_once_or_not_at_all(tmp_path, calls):
    root = tmp_path / "root"
    params, opt = tiny(seed=0)
    _, reader = tiny(seed=5)
    ck = ckpt.Checkpointer(root, opt)
    ck.save(1)
    calls.wrap("ckpt_checkpointer_save_async", out=True)
    calls.wrap("ckpt_pending_save_finalize")
    calls.wrap("ckpt_pending_save_destroy")
    seen = {"before": 0, "after": 0, "done": 0}

    def run_one(it):
        step = it.k + 2
        train(params, opt, seed=it.k)
        old = ck.latest
        pending = ck.save_async(step)
        handle = calls.made["ckpt_checkpointer_save_async"][-1]
        for name in ("ckpt_pending_save_finalize", "ckpt_pending_save_destroy"):
            calls.log[name].clear()  # A freed handle's address may come back.
        _, interrupt = it.run(pending.finalize)
        finalized = [h for h, _ in calls.log["ckpt_pending_save_finalize"] if h == handle]
        destroyed = [h for h, _ in calls.log["ckpt_pending_save_destroy"] if h == handle]
        if not finalized:
            assert interrupt is not None and not destroyed
            assert pending._native._handle.value == handle and ck.pending is pending
            assert ck.latest == old == latest_on_disk(root, reader)
            pending.finalize()  # Still there to commit.
            seen["before"] += 1
        else:
            assert len(finalized) == len(destroyed) == 1
            assert pending._native._handle is None and ck.pending is None
            seen["after" if interrupt is not None else "done"] += 1
        assert ck.latest == step == latest_on_disk(root, reader)
        with pytest.raises(ckpt.CkptError, match="already finalized"):
            pending.finalize()
        return interrupt is not None

    every_line(run_one)
    assert seen["before"] > 0 and seen["after"] > 0 and seen["done"] == 1, seen
    ck.close()


def test_deferred_signals_nest_and_reach_the_previous_handlers():
    got = []
    old_term = signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
    try:
        with pytest.raises(KeyboardInterrupt):
            with _signals.deferred():
                with _signals.deferred():
                    signal.raise_signal(signal.SIGINT)
                    signal.raise_signal(signal.SIGTERM)
                got.append("inner done")  # Delivered to the outer section: still deferred.
            got.append("unreachable")
        assert got == ["inner done", signal.SIGTERM]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        # Off the main thread nothing is deferred, and nothing is touched.
        errors = []

        def off_main():
            try:
                with _signals.deferred():
                    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
            except BaseException as e:  # Reported to the main thread's assert.
                errors.append(e)

        t = threading.Thread(target=off_main)
        t.start()
        t.join()
        assert errors == []
    finally:
        signal.signal(signal.SIGTERM, old_term)


def save_steps(root):
    """Steps 1 to 3 saved normally; returns {step: (state, extra)}."""
    params, opt = tiny(seed=0)
    ck = ckpt.Checkpointer(root, opt)
    out = {}
    for step in (1, 2, 3):
        train(params, opt, seed=step)
        opt.param_groups[1]["lr"] = 1e-4 * step
        ck.save(step, extra={"step": step})
        out[step] = (state(params, opt), {"step": step})
    ck.close()
    opt.close()
    return out


def listing(root):
    return sorted((os.path.relpath(os.path.join(d, f), root),
                   os.stat(os.path.join(d, f)).st_mtime_ns)
                  for d, _, files in os.walk(root) for f in files)


def test_read_only_checkpointer_loads_and_refuses_to_save(tmp_path):
    root = tmp_path / "root"
    saved = save_steps(root)
    params, opt = tiny(seed=9)
    with pytest.raises(ValueError, match="read_only"):
        ckpt.Checkpointer(root, opt, read_only=True, keep_last=2)
    files = listing(root)
    ck = ckpt.Checkpointer(root, opt, read_only=True)
    # No LOCK taken: the job that owns the root opens it beside the reader.
    _, other = tiny(seed=3)
    ckpt.Checkpointer(root, other).close()
    assert ck.latest == 3
    assert ck.load() == saved[3][1] and same(state(params, opt), saved[3][0])
    assert ck.load(2) == saved[2][1] and same(state(params, opt), saved[2][0])
    for save in (ck.save, ck.save_async):
        with pytest.raises(ckpt.CkptError, match="read_only=True") as refused:
            save(4)
        assert refused.value.code == "FAILED_PRECONDITION"
    ck.close()
    assert listing(root) == files  # Nothing written, not even an undo spill.


CHILD = textwrap.dedent("""
    import errno, os, sys, torch
    sys.path.insert(0, sys.argv[3])
    import ckpt
    from test_atomic_and_paths import same, state, tiny
    root, want, read_only_fs = sys.argv[1], torch.load(sys.argv[2]), sys.argv[4] == "1"
    if read_only_fs:
        try:
            open(os.path.join(root, "probe"), "w")
            sys.exit("the bind mount is writable")
        except OSError as e:
            assert e.errno == errno.EROFS, e
    params, opt = tiny(seed=9)
    ck = ckpt.Checkpointer(root, opt, read_only=True)
    assert ck.load() == {"step": 3}
    assert same(state(params, opt), want)
    try:
        ck.save(4)
        sys.exit("a read-only Checkpointer saved")
    except ckpt.CkptError as e:
        assert e.code == "FAILED_PRECONDITION" and "read_only=True" in str(e), e
    ck.close()
    print("loaded read-only", "from a read-only file system" if read_only_fs else "")
""")


def test_read_only_load_on_a_read_only_file_system(tmp_path):
    root = tmp_path / "root"
    saved = save_steps(root)
    torch.save(saved[3][0], tmp_path / "want.pt")
    mount = tmp_path / "ro"
    mount.mkdir()
    # A private mount namespace (as root of a user namespace): the read-only bind mount exists
    # only for the child and goes with it.
    shell = ('mount --bind -o ro "$1" "$2" || exit 77; '
             'exec "$3" -c "$4" "$2" "$5" "$6" 1')
    args = [str(root), str(mount), sys.executable, CHILD, str(tmp_path / "want.pt"), HERE]
    try:
        run = subprocess.run(["unshare", "--mount", "--map-root-user", "sh", "-c", shell, "sh",
                              *args], capture_output=True, text=True, timeout=120)
        mounted = run.returncode != 77 and "unshare:" not in run.stderr
    except FileNotFoundError:
        mounted = False
    if not mounted:  # Mounting is not permitted here: the same load on a normal directory.
        run = subprocess.run([sys.executable, "-c", CHILD, str(root), str(tmp_path / "want.pt"),
                              HERE, "0"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert ("from a read-only file system" in run.stdout) == mounted
    assert not os.listdir(mount)  # The mount did not outlive the child.


def test_nul_bytes_in_paths_raise_value_error(tmp_path):
    params, opt = tiny(seed=0)
    for root in (str(tmp_path / "a\0b"), bytes(tmp_path / "a") + b"\0b", tmp_path / "a\0b"):
        with pytest.raises(ValueError, match="root contains a NUL byte"):
            ckpt.Checkpointer(root, opt)
    assert not (tmp_path / "a").exists()  # Not truncated to ".../a" and created.
    with pytest.raises(TypeError):
        ckpt.Checkpointer(42, opt)
    ck = ckpt.Checkpointer(os.fsencode(tmp_path / "root"), opt)  # bytes are a path too.
    ck.save(1)
    with pytest.raises(ValueError, match="source contains a NUL byte"):
        ck.load_model(tmp_path / "root\0.safetensors")
    with pytest.raises(ValueError, match="rename pattern contains a NUL byte"):
        ck.load_model(tmp_path / "root", rename=[("^w\0", "x")])
    with pytest.raises(ValueError, match="rename replacement contains a NUL byte"):
        ck.load_model(tmp_path / "root", rename=[("^w", "x\0")])
    assert ck.latest == 1 and opt.lifecycle == "clean"
    ck.close()
    with pytest.raises(ValueError, match="parameter name contains a NUL byte"):
        ckpt.torch.StagedAdamW([("w\0x", torch.nn.Parameter(torch.zeros(2)))])


def test_extra_over_256_mib_is_refused_and_nothing_is_committed(tmp_path):
    params, opt = tiny(seed=0)
    ck = ckpt.Checkpointer(tmp_path / "root", opt)
    ck.save(1)
    big = {"blob": bytes(256 << 20)}  # Pickled, a few bytes more than a blob holds (256 MiB).
    with pytest.raises(ckpt.CkptError, match="more than a blob may hold") as refused:
        ck.save(2, extra=big)
    assert refused.value.code == "INVALID_ARGUMENT" and ck.latest == 1
    pending = ck.save_async(2, extra=big)  # Refused when its writer reaches the blob.
    with pytest.raises(ckpt.CkptError, match="more than a blob may hold") as refused:
        pending.finalize()
    assert refused.value.code == "INVALID_ARGUMENT" and ck.latest == 1
    ck.save(2)
    assert ck.latest == 2
    ck.close()
