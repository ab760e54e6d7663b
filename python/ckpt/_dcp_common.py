"""What ckpt.dcp's writer (ckpt/_dcp_writer.py) and reader (ckpt/dcp.py) share: the dtypes a
store holds, the names of DCP's items in a store, box arithmetic on the flat index, and store
handles."""
import ctypes
import os
import re

import torch

from . import _lib
from ._lib import CkptError, check, lib
from ._native import Native

METADATA_BLOB = "dcp.metadata"
STEP_DIR = re.compile(r"step-0*(\d+)")
DTYPES = {torch.float32: _lib.F32, torch.bfloat16: _lib.BF16, torch.float16: _lib.F16,
           torch.float64: _lib.F64, torch.int64: _lib.I64, torch.int32: _lib.I32,
           torch.int16: _lib.I16, torch.int8: _lib.I8, torch.uint8: _lib.U8,
           torch.bool: _lib.BOOL}
TORCH_DTYPES = {code: dtype for dtype, code in DTYPES.items()}
# Bytes a read of a box may span beyond the box itself, to make one read of many short runs.
SPAN_SLACK_BYTES = 64 << 20


def split_checkpoint_id(checkpoint_id):
    """(root, step) of a DCP checkpoint id naming a step directory ("ckpts/step-100", or ckpt's
    own "ckpts/step-00000100"); (checkpoint_id, None) for any other path (a store's root)."""
    path = os.path.normpath(os.fspath(checkpoint_id))
    head, tail = os.path.split(path)
    match = STEP_DIR.fullmatch(tail)
    if match is None:
        return path, None
    return head or ".", int(match.group(1))


def names_a_step(checkpoint_id):
    """DCP's validate_checkpoint_id, for the writer and the reader: an id naming a step."""
    try:
        return split_checkpoint_id(checkpoint_id)[1] is not None
    except TypeError:
        return False


def latest_step(root):
    """The step LATEST of store `root` names (what a resume loads), or None when nothing is
    committed there (or there is no store)."""
    if not os.path.isdir(root):
        return None
    store = open_store(root, False, read_only=True)
    try:
        return latest(store)
    finally:
        store.close()


def latest(store):
    has, step = ctypes.c_int(), ctypes.c_uint64()
    check(lib.ckpt_store_latest(store.handle, ctypes.byref(has), ctypes.byref(step)))
    return step.value if has.value else None


def store_name(fqn):
    # A fully qualified name as a ckpt tensor or blob name: ckpt refuses '/', '\\', "..",
    # control characters; '@' is escaped too, as it separates a chunk's offsets.
    out = []
    for i, c in enumerate(fqn):
        if c in "%/\\@" or ord(c) < 0x20 or ord(c) == 0x7F or (c == "." and fqn[i - 1:i] == "."):
            out.append("%%%02X" % ord(c))
        else:
            out.append(c)
    return "".join(out)


def strides(shape):
    out, at = [], 1
    for n in reversed(shape):
        out.append(at)
        at *= n
    return list(reversed(out))


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def flat_range(shape, offsets, sizes):
    """(begin, count) when box `offsets`/`sizes` of a tensor of `shape` is one range of its flat
    index (dims before the one cut hold one index each); None otherwise."""
    cut = [d for d in range(len(shape)) if sizes[d] != shape[d]]
    if cut and any(sizes[d] != 1 for d in range(cut[-1])):
        return None
    begin = sum(o * s for o, s in zip(offsets, strides(shape)))
    return begin, numel(sizes)


def runs(shape, offsets, sizes):
    """The box's ranges of the flat index, in the box's row-major order: (begin, count)."""
    d = len(shape)
    while d > 0 and sizes[d - 1] == shape[d - 1]:
        d -= 1
    if d == 0:
        return [(0, numel(shape))] if numel(sizes) else []
    stride = strides(shape)
    run = sizes[d - 1] * stride[d - 1]
    base = sum(o * s for o, s in zip(offsets, stride))
    starts = [base]
    for j in range(d - 1):
        starts = [s + i * stride[j] for s in starts for i in range(sizes[j])]
    return [(s, run) for s in starts] if run else []


def check_code(code, what):
    if code != _lib.OK:
        message = lib.ckpt_last_error()
        text = message.decode("utf-8", "replace") if message else ""
        raise CkptError(code, f"{what}: {text}")


def open_store(root, primary, read_only=False, keep_last=0, keep_every=0):
    options = _lib.StoreOptions(ctypes.sizeof(_lib.StoreOptions), 1 if primary else 0,
                                1 if read_only else 0, keep_last, keep_every, 0)
    handle = ctypes.c_void_p()
    check(lib.ckpt_store_open_with(_lib.encode_path(root, "root"), ctypes.byref(options),
                                   ctypes.byref(handle)))
    return Native(handle, lib.ckpt_store_close, "store")


def pinned(nbytes):
    """Host memory the GPU copies into and out of asynchronously, at the bus's speed."""
    return torch.empty(max(1, nbytes), dtype=torch.uint8, pin_memory=True)


