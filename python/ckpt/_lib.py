"""ctypes binding of libckpt_c.so (include/ckpt/ckpt.h): the one place that knows the C ABI.

The library is found, in order, at $CKPT_LIB, beside this package (an installed wheel or a
copy), in the build tree this package sits in (../../build/capi), and on the system's library
path (ctypes.util.find_library("ckpt_c"), e.g. after `cmake --install`).
"""
import ctypes
import ctypes.util
import enum
import os

ABI_VERSION = 16



class Code(enum.IntEnum):
    """absl's canonical status codes, as the C ABI returns them (CKPT_OK, CKPT_NOT_FOUND, ...)
    and as Python raises its own CkptErrors: by name, never a bare number."""
    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15


OK = Code.OK
CODE_NAMES = {c.value: c.name for c in Code if c is not Code.OK}
F32, BF16, F16 = 0, 1, 2
# Store tensors' further dtypes (ABI 9).
F64, I64, I32, I16, I8, U8, BOOL = 3, 4, 5, 6, 7, 8, 9
ENGINE_CPU, ENGINE_CUDA = 0, 1
MOMENTS_F32, MOMENTS_BF16 = 0, 1
MASTER, EXP_AVG, EXP_AVG_SQ, MAX_EXP_AVG_SQ = 0, 1, 2, 3
# State shaped unlike its parameter (Adafactor's factors), by aux offsets (ABI 16).
AUX = 4
LIFECYCLE = {0: "clean", 1: "loading", 2: "poisoned"}
# A param group's update rule, and Muon's lr rules (ABI 11).
ADAMW, MUON = 0, 1
ADAFACTOR = 2  # ABI 16: its own hyper-parameters by name (ckpt_optimizer_set_hyper).
MUON_LR_ORIGINAL, MUON_LR_MATCH_RMS_ADAMW = 0, 1
LOAD_MODEL_IGNORE_UNEXPECTED, LOAD_MODEL_MASTERS = 1, 2


class CkptError(Exception):
    """A ckpt call failed: `code` is absl's canonical code name ("DATA_LOSS", ...), the message
    ckpt's own (naming the file, tensor or offset)."""

    def __init__(self, code, message):
        self.code = CODE_NAMES.get(code, str(code))
        self._raw = (code, message)
        super().__init__(f"{self.code}: {message}")

    def __reduce__(self):
        # Picklable, as torch.distributed sends a rank's exception to the others (DCP does).
        return (type(self), self._raw)


class Param(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("shape", ctypes.POINTER(ctypes.c_uint64)),
                ("ndim", ctypes.c_size_t), ("dtype", ctypes.c_int), ("group", ctypes.c_uint32)]


class Group(ctypes.Structure):
    _fields_ = [("lr", ctypes.c_double), ("beta1", ctypes.c_double), ("beta2", ctypes.c_double),
                ("eps", ctypes.c_double), ("weight_decay", ctypes.c_double),
                ("step", ctypes.c_uint64), ("amsgrad", ctypes.c_int),
                ("algorithm", ctypes.c_int), ("momentum", ctypes.c_double),
                ("nesterov", ctypes.c_int), ("ns_a", ctypes.c_double), ("ns_b", ctypes.c_double),
                ("ns_c", ctypes.c_double), ("ns_steps", ctypes.c_uint32),
                ("adjust_lr", ctypes.c_int)]


class State(ctypes.Structure):
    """ckpt_state (ABI 16): the whole state at once, aux state too."""
    _fields_ = [("struct_size", ctypes.c_size_t), ("master", ctypes.c_void_p),
                ("exp_avg", ctypes.c_void_p), ("exp_avg_sq", ctypes.c_void_p),
                ("max_exp_avg_sq", ctypes.c_void_p), ("count", ctypes.c_uint64),
                ("param_steps", ctypes.POINTER(ctypes.c_uint64)), ("nparams", ctypes.c_size_t),
                ("aux", ctypes.c_void_p), ("aux_count", ctypes.c_uint64)]


class Piece(ctypes.Structure):
    _fields_ = [("param", ctypes.c_uint32), ("begin", ctypes.c_uint64), ("count", ctypes.c_uint64)]


class OptimizerOptions(ctypes.Structure):
    _fields_ = [("engine", ctypes.c_int), ("unit_bytes", ctypes.c_uint64), ("threads", ctypes.c_int),
                ("slot_count", ctypes.c_int), ("moment_dtype", ctypes.c_int)]


ALL_GATHER = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                              ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t))
BARRIER = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


class StoreOptions(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("primary", ctypes.c_int),
                ("read_only", ctypes.c_int), ("keep_last", ctypes.c_uint64),
                ("keep_every", ctypes.c_uint64), ("write_threads", ctypes.c_int)]


class Coordinator(ctypes.Structure):
    _fields_ = [("user", ctypes.c_void_p), ("rank", ctypes.c_int), ("size", ctypes.c_int),
                ("all_gather", ALL_GATHER), ("barrier", BARRIER)]


def _candidates():
    env = os.environ.get("CKPT_LIB")
    if env:
        yield env
    here = os.path.dirname(os.path.abspath(__file__))
    yield os.path.join(here, "libckpt_c.so")
    yield os.path.join(here, "..", "..", "build", "capi", "libckpt_c.so")
    found = ctypes.util.find_library("ckpt_c")
    if found:
        yield found


def _load():
    tried = []
    for path in _candidates():
        if path and (os.path.exists(path) or "/" not in path):
            try:
                lib = ctypes.CDLL(path)
            except OSError as e:
                tried.append(f"{path} ({e})")
                continue
            return lib
        tried.append(f"{path} (absent)")
    raise ImportError("ckpt: libckpt_c.so not found; build it (cmake --build build) or set "
                      "CKPT_LIB to its path. Tried: " + "; ".join(tried))


lib = _load()
_p = ctypes.c_void_p
_sig = {
    "ckpt_abi_version": ([], ctypes.c_int),
    "ckpt_abi_layout": ([], ctypes.c_char_p),
    "ckpt_last_error": ([], ctypes.c_char_p),
    "ckpt_alloc": ([ctypes.c_size_t], ctypes.c_void_p),
    "ckpt_rank_pieces": ([ctypes.POINTER(Param), ctypes.c_size_t, ctypes.c_uint64, ctypes.c_int,
                          ctypes.c_int, ctypes.POINTER(Piece), ctypes.c_size_t,
                          ctypes.POINTER(ctypes.c_size_t)], ctypes.c_int),
    "ckpt_rank_pieces_keeping_whole": ([ctypes.POINTER(Param), ctypes.c_size_t,
                                        ctypes.POINTER(ctypes.c_uint8), ctypes.c_uint64,
                                        ctypes.c_int, ctypes.c_int, ctypes.POINTER(Piece),
                                        ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)],
                                       ctypes.c_int),
    "ckpt_optimizer_create": ([ctypes.POINTER(Param), ctypes.c_size_t, ctypes.POINTER(Group),
                               ctypes.c_size_t, ctypes.POINTER(Piece), ctypes.c_size_t,
                               ctypes.POINTER(OptimizerOptions), _p, ctypes.c_size_t,
                               ctypes.POINTER(_p)], ctypes.c_int),
    "ckpt_optimizer_destroy": ([_p], None),
    "ckpt_optimizer_size": ([_p, ctypes.POINTER(ctypes.c_uint64)], ctypes.c_int),
    "ckpt_optimizer_step": ([_p, _p, ctypes.c_int, ctypes.c_float, _p, ctypes.c_int, _p,
                             ctypes.POINTER(ctypes.c_int)], ctypes.c_int),
    "ckpt_optimizer_step_pieces": ([_p, ctypes.POINTER(_p), ctypes.POINTER(_p), ctypes.c_size_t,
                                    ctypes.c_int, ctypes.c_float, ctypes.c_int, _p,
                                    ctypes.POINTER(ctypes.c_int)], ctypes.c_int),
    "ckpt_optimizer_write_weights": ([_p, _p, ctypes.c_int, _p], ctypes.c_int),
    "ckpt_optimizer_num_groups": ([_p, ctypes.POINTER(ctypes.c_size_t)], ctypes.c_int),
    "ckpt_optimizer_get_group": ([_p, ctypes.c_size_t, ctypes.POINTER(Group)], ctypes.c_int),
    "ckpt_optimizer_set_group": ([_p, ctypes.c_size_t, ctypes.POINTER(Group)], ctypes.c_int),
    "ckpt_optimizer_read_state": ([_p, ctypes.c_int, _p, ctypes.c_uint64], ctypes.c_int),
    "ckpt_optimizer_read_state_range": ([_p, ctypes.c_int, ctypes.c_uint64, _p, ctypes.c_uint64],
                                        ctypes.c_int),
    "ckpt_optimizer_set_state": ([_p, _p, _p, _p, ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64),
                                  ctypes.c_size_t], ctypes.c_int),
    "ckpt_optimizer_step_masked": ([_p, ctypes.POINTER(_p), ctypes.POINTER(_p), ctypes.c_size_t,
                                    _p, ctypes.c_size_t, ctypes.c_int, ctypes.c_float,
                                    ctypes.c_int, _p, ctypes.POINTER(ctypes.c_int)],
                                   ctypes.c_int),
    "ckpt_optimizer_step_gated": ([_p, ctypes.POINTER(_p), ctypes.POINTER(_p), ctypes.c_size_t,
                                   _p, ctypes.c_size_t, ctypes.c_int, ctypes.c_float,
                                   ctypes.c_int, _p, ctypes.POINTER(ctypes.c_int),
                                   ctypes.POINTER(ctypes.c_int)], ctypes.c_int),
    "ckpt_overlap_begin": ([_p, ctypes.c_int, ctypes.c_float, _p, ctypes.c_int,
                            ctypes.POINTER(_p)], ctypes.c_int),
    "ckpt_overlap_release": ([_p, ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(_p),
                              ctypes.POINTER(_p), ctypes.c_size_t], ctypes.c_int),
    "ckpt_overlap_drain": ([_p], ctypes.c_int),
    "ckpt_overlap_invalidate": ([_p], ctypes.c_int),
    "ckpt_overlap_finish": ([_p, ctypes.POINTER(_p), ctypes.POINTER(_p), ctypes.c_size_t, _p,
                             ctypes.c_size_t, ctypes.c_int, ctypes.c_float, ctypes.c_int, _p,
                             ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_uint64),
                             ctypes.POINTER(ctypes.c_int)], ctypes.c_int),
    "ckpt_overlap_destroy": ([_p], None),
    "ckpt_overlap_begin_gated": ([_p, ctypes.c_int, ctypes.c_float, _p, ctypes.c_uint32,
                                  ctypes.POINTER(_p)], ctypes.c_int),
    "ckpt_optimizer_gate_open": ([_p, ctypes.POINTER(ctypes.c_int)], ctypes.c_int),
    "ckpt_optimizer_await_pieces": ([_p, ctypes.POINTER(ctypes.c_uint32), ctypes.c_size_t, _p],
                                    ctypes.c_int),
    "ckpt_optimizer_await_step": ([_p, _p], ctypes.c_int),
    "ckpt_optimizer_param_steps": ([_p, ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t],
                                   ctypes.c_int),
    "ckpt_optimizer_set_param_state": ([_p, _p, _p, _p, _p, ctypes.c_uint64,
                                        ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t],
                                       ctypes.c_int),
    "ckpt_optimizer_set_masters": ([_p, ctypes.c_uint64, _p, ctypes.c_uint64], ctypes.c_int),
    "ckpt_optimizer_add_params": ([_p, ctypes.POINTER(Param), ctypes.c_size_t,
                                   ctypes.POINTER(Group), ctypes.c_size_t, ctypes.POINTER(Piece),
                                   ctypes.c_size_t, _p, ctypes.c_size_t], ctypes.c_int),
    "ckpt_optimizer_write_piece_weights": ([_p, ctypes.POINTER(_p), ctypes.c_size_t, ctypes.c_int,
                                            _p], ctypes.c_int),
    "ckpt_optimizer_lifecycle": ([_p, ctypes.POINTER(ctypes.c_int)], ctypes.c_int),
    "ckpt_store_open": ([ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.POINTER(_p)],
                        ctypes.c_int),
    "ckpt_store_open_with": ([ctypes.c_char_p, ctypes.POINTER(StoreOptions), ctypes.POINTER(_p)],
                             ctypes.c_int),
    "ckpt_store_open_on_ranks": ([ctypes.c_char_p, ctypes.POINTER(StoreOptions),
                                  ctypes.POINTER(Coordinator), ctypes.POINTER(_p)],
                                 ctypes.c_int),
    "ckpt_store_close": ([_p], None),
    "ckpt_store_keep_only": ([_p, ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t,
                              ctypes.POINTER(ctypes.c_size_t)], ctypes.c_int),
    "ckpt_store_adopt": ([_p, ctypes.c_uint64], ctypes.c_int),
    # Store steps (ABI 15).
    "ckpt_store_steps": ([_p, ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t,
                          ctypes.POINTER(ctypes.c_size_t)], ctypes.c_int),
    "ckpt_optimizer_get_hyper": ([_p, ctypes.c_size_t, ctypes.c_char_p,
                                  ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_int)],
                                 ctypes.c_int),
    "ckpt_optimizer_set_hyper": ([_p, ctypes.c_size_t, ctypes.c_char_p,
                                  ctypes.POINTER(ctypes.c_double)], ctypes.c_int),
    "ckpt_optimizer_aux_offsets": ([_p, ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t],
                                   ctypes.c_int),
    "ckpt_optimizer_set_state_with": ([_p, ctypes.POINTER(State)], ctypes.c_int),
    "ckpt_store_latest": ([_p, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_uint64)],
                          ctypes.c_int),
    "ckpt_checkpointer_open": ([_p, _p, ctypes.POINTER(Coordinator), ctypes.c_uint64,
                                ctypes.POINTER(_p)], ctypes.c_int),
    "ckpt_checkpointer_create": ([_p, _p, ctypes.c_size_t, _p, ctypes.POINTER(Coordinator),
                                  ctypes.c_uint64, ctypes.POINTER(_p)], ctypes.c_int),
    "ckpt_checkpointer_destroy": ([_p], None),
    "ckpt_checkpointer_save": ([_p, ctypes.c_uint64, ctypes.POINTER(ctypes.c_char_p),
                                ctypes.POINTER(_p), ctypes.POINTER(ctypes.c_size_t),
                                ctypes.c_size_t], ctypes.c_int),
    "ckpt_checkpointer_save_async": ([_p, ctypes.c_uint64, ctypes.POINTER(ctypes.c_char_p),
                                      ctypes.POINTER(_p), ctypes.POINTER(ctypes.c_size_t),
                                      ctypes.c_size_t, ctypes.POINTER(_p)], ctypes.c_int),
    "ckpt_pending_save_finalize": ([_p], ctypes.c_int),
    "ckpt_pending_save_writer_done": ([_p, ctypes.POINTER(ctypes.c_int)], ctypes.c_int),
    "ckpt_pending_save_destroy": ([_p], None),
    "ckpt_checkpointer_load": ([_p, ctypes.c_int, ctypes.c_uint64, ctypes.POINTER(_p),
                                ctypes.POINTER(ctypes.c_uint64)], ctypes.c_int),
    "ckpt_checkpointer_load_newest_intact": ([_p, ctypes.POINTER(_p),
                                              ctypes.POINTER(ctypes.c_uint64),
                                              ctypes.POINTER(ctypes.c_uint64)], ctypes.c_int),
    "ckpt_checkpointer_load_model": ([_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p),
                                      ctypes.POINTER(ctypes.c_char_p), ctypes.c_size_t,
                                      ctypes.c_int], ctypes.c_int),
    "ckpt_blobs_count": ([_p, ctypes.POINTER(ctypes.c_size_t)], ctypes.c_int),
    "ckpt_blobs_get": ([_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(_p),
                        ctypes.POINTER(ctypes.c_size_t)], ctypes.c_int),
    "ckpt_blobs_free": ([_p], None),
    "ckpt_save_begin": ([_p, ctypes.c_uint64, ctypes.POINTER(Coordinator), ctypes.POINTER(_p)],
                        ctypes.c_int),
    "ckpt_save_declare": ([_p, ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(ctypes.c_uint64),
                          ctypes.c_size_t], ctypes.c_int),
    "ckpt_save_write": ([_p, ctypes.c_char_p, ctypes.c_uint64, ctypes.c_uint64, _p,
                        ctypes.c_size_t], ctypes.c_int),
    "ckpt_save_write_blob": ([_p, ctypes.c_char_p, _p, ctypes.c_size_t], ctypes.c_int),
    "ckpt_save_commit": ([_p], ctypes.c_int),
    "ckpt_save_abort": ([_p], ctypes.c_int),
    "ckpt_save_destroy": ([_p], None),
    "ckpt_reader_open": ([_p, ctypes.c_uint64, ctypes.POINTER(_p)], ctypes.c_int),
    "ckpt_reader_close": ([_p], None),
    "ckpt_reader_tensor": ([_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int),
                           ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t,
                           ctypes.POINTER(ctypes.c_size_t)], ctypes.c_int),
    "ckpt_reader_read": ([_p, ctypes.c_char_p, ctypes.c_uint64, ctypes.c_uint64, _p,
                         ctypes.c_size_t], ctypes.c_int),
    "ckpt_reader_read_many": ([_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_char_p),
                              ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                              ctypes.POINTER(_p), ctypes.POINTER(ctypes.c_size_t)], ctypes.c_int),
    "ckpt_reader_blob": ([_p, ctypes.c_char_p, ctypes.c_uint32, _p, ctypes.c_size_t,
                         ctypes.POINTER(ctypes.c_size_t)], ctypes.c_int),
}
lib.ckpt_abi_version.argtypes = []
lib.ckpt_abi_version.restype = ctypes.c_int
# Versions only add functions: a library of this package's version or newer serves it.
if lib.ckpt_abi_version() < ABI_VERSION:
    raise ImportError(f"ckpt: libckpt_c.so implements ABI {lib.ckpt_abi_version()}, this package "
                      f"needs {ABI_VERSION} or newer")

# The structs of ckpt.h this table mirrors, by their C names.
STRUCTS = [("ckpt_param", Param), ("ckpt_group", Group), ("ckpt_piece", Piece),
           ("ckpt_state", State),
           ("ckpt_optimizer_options", OptimizerOptions), ("ckpt_store_options", StoreOptions),
           ("ckpt_coordinator", Coordinator)]
CONSTANTS = dict(
    {"CKPT_ABI_VERSION": ABI_VERSION, "CKPT_OK": OK, "CKPT_ADAMW": ADAMW, "CKPT_MUON": MUON,
     "CKPT_ADAFACTOR": ADAFACTOR, "CKPT_AUX": AUX,
     "CKPT_MUON_LR_ORIGINAL": MUON_LR_ORIGINAL,
     "CKPT_MUON_LR_MATCH_RMS_ADAMW": MUON_LR_MATCH_RMS_ADAMW,
     "CKPT_LOAD_MODEL_IGNORE_UNEXPECTED": LOAD_MODEL_IGNORE_UNEXPECTED,
     "CKPT_LOAD_MODEL_MASTERS": LOAD_MODEL_MASTERS, "CKPT_F32": F32, "CKPT_BF16": BF16,
     "CKPT_F16": F16, "CKPT_F64": F64, "CKPT_I64": I64, "CKPT_I32": I32, "CKPT_I16": I16,
     "CKPT_I8": I8, "CKPT_U8": U8, "CKPT_BOOL": BOOL, "CKPT_ENGINE_CPU": ENGINE_CPU, "CKPT_ENGINE_CUDA": ENGINE_CUDA,
     "CKPT_MOMENTS_F32": MOMENTS_F32, "CKPT_MOMENTS_BF16": MOMENTS_BF16, "CKPT_MASTER": MASTER,
     "CKPT_EXP_AVG": EXP_AVG, "CKPT_EXP_AVG_SQ": EXP_AVG_SQ,
     "CKPT_MAX_EXP_AVG_SQ": MAX_EXP_AVG_SQ},
    **{"CKPT_LIFECYCLE_" + name.upper(): value for value, name in LIFECYCLE.items()},
    **{"CKPT_" + name: value for value, name in CODE_NAMES.items()})
_KINDS = {ctypes.c_int: "i32", ctypes.c_uint32: "u32", ctypes.c_int64: "i64",
          ctypes.c_uint64: "u64", ctypes.c_float: "f32", ctypes.c_double: "f64"}


def _kind(t):
    if t is None:
        return "void"
    if t in (ctypes.c_void_p, ctypes.c_char_p) or issubclass(t, (ctypes._Pointer,
                                                                  ctypes._CFuncPtr)):
        return "p"
    return _KINDS.get(t, f"?{t.__name__}")


def package_layout(structs=STRUCTS, sig=_sig, constants=CONSTANTS):
    """This package's view of the ABI, as lines of ckpt_abi_layout()'s grammar (ckpt.h)."""
    lines = []
    for name, cls in structs:
        lines.append(f"struct {name} {ctypes.sizeof(cls)}")
        for field, ftype in cls._fields_:
            lines.append(f"field {name}.{field} {getattr(cls, field).offset} {_kind(ftype)}")
    for name, (args, res) in sig.items():
        lines.append(" ".join(["func", name, _kind(res)] + [_kind(a) for a in args]))
    for name, value in constants.items():
        lines.append(f"const {name} {value}")
    return lines


def layout_mismatches(library_text, package_lines):
    """The package's lines the library's layout does not confirm, each with what the library
    says instead (or that it lacks the item). A library may be newer: it may add functions and
    constants, and grow a struct that starts with struct_size (its callers say which size they
    know); everything else must be equal."""
    library = {}
    for line in library_text.splitlines():
        parts = line.split(" ")
        if len(parts) >= 2:
            library[(parts[0], parts[1])] = line
    grows = {line.split(" ")[1].split(".")[0] for line in package_lines
             if line.startswith("field ") and line.split(" ")[1].endswith(".struct_size")
             and line.split(" ")[2] == "0"}
    problems = []
    for line in package_lines:
        parts = line.split(" ")
        theirs = library.get((parts[0], parts[1]))
        if theirs == line:
            continue
        if (theirs is not None and parts[0] == "struct" and parts[1] in grows
                and int(theirs.split(" ")[2]) >= int(parts[2])):
            continue
        if theirs is not None and parts[1] == "CKPT_ABI_VERSION" and (
                int(theirs.split(" ")[2]) >= int(parts[2])):
            continue
        problems.append(f"package: {line!r}, library: "
                        + (repr(theirs) if theirs is not None else "none"))
    return problems


# A hand-kept table would corrupt memory silently on a layout change: it is compared with the
# layout the library was compiled with before any other call.
lib.ckpt_abi_layout.argtypes = []
lib.ckpt_abi_layout.restype = ctypes.c_char_p
_problems = layout_mismatches(lib.ckpt_abi_layout().decode(), package_layout())
if _problems:
    raise ImportError("ckpt: this package's ctypes table disagrees with the ABI layout of "
                          "libckpt_c.so (a package and a library of different builds?): "
                          + "; ".join(_problems))

for _name, (_args, _res) in _sig.items():
    _f = getattr(lib, _name)
    _f.argtypes = _args
    _f.restype = _res


def _no_nul(raw, what, value):
    # ctypes passes bytes as char*: C would read a NUL as the end and see another string.
    if b"\0" in raw:
        raise ValueError(f"{what} contains a NUL byte: {value!r}")
    return raw


def encode_path(value, what):
    """A path (str, bytes or os.PathLike) as the bytes C gets (os.fsencode). Raises TypeError
    for anything else, ValueError naming `what` when it holds a NUL byte."""
    return _no_nul(os.fsencode(value), what, value)


def encode_text(value, what):
    """A str as the UTF-8 bytes C gets. Raises ValueError naming `what` when it holds a NUL."""
    return _no_nul(value.encode(), what, value)


def check(code):
    """Raises CkptError for a failed call's code, with ckpt's message."""
    if code != OK:
        message = lib.ckpt_last_error()
        raise CkptError(code, message.decode("utf-8", "replace") if message else "")
