"""The ctypes table of python/ckpt/_lib.py against the ABI layout libckpt_c.so was compiled
with (ckpt_abi_layout): equal today, and every kind of drift is caught before a call."""
import ctypes

from ckpt import _lib


def _library():
    return _lib.lib.ckpt_abi_layout().decode()


def test_the_package_table_matches_the_library_layout():
    lines = _lib.package_layout()
    assert _lib.layout_mismatches(_library(), lines) == []
    # Every function the package binds and every struct it mirrors was compared.
    assert sum(line.startswith("func ") for line in lines) == len(_lib._sig)
    assert sum(line.startswith("struct ") for line in lines) == 7


def test_a_field_of_another_width_is_named():
    class Piece(ctypes.Structure):  # count as 32 bits: every later piece would be misread.
        _fields_ = [("param", ctypes.c_uint32), ("begin", ctypes.c_uint64),
                    ("count", ctypes.c_uint32)]
    structs = [(n, Piece if n == "ckpt_piece" else c) for n, c in _lib.STRUCTS]
    problems = _lib.layout_mismatches(_library(), _lib.package_layout(structs=structs))
    # Padding keeps the struct's size: only the field itself tells.
    assert problems == ["package: 'field ckpt_piece.count 16 u32', library: "
                        "'field ckpt_piece.count 16 u64'"]


def test_a_function_with_other_arguments_or_absent_from_the_library_is_named():
    sig = dict(_lib._sig)
    args, res = sig["ckpt_optimizer_step"]
    sig["ckpt_optimizer_step"] = (args[:3] + [ctypes.c_double] + args[4:], res)
    sig["ckpt_not_in_the_library"] = ([], ctypes.c_int)
    problems = _lib.layout_mismatches(_library(), _lib.package_layout(sig=sig))
    assert any("ckpt_optimizer_step" in p and "f64" in p for p in problems), problems
    assert any("ckpt_not_in_the_library" in p and "library: none" in p for p in problems)


def test_a_constant_of_another_value_is_named():
    constants = dict(_lib.CONSTANTS, CKPT_EXP_AVG_SQ=7)
    problems = _lib.layout_mismatches(_library(), _lib.package_layout(constants=constants))
    assert problems == [f"package: 'const CKPT_EXP_AVG_SQ 7', library: "
                        f"'const CKPT_EXP_AVG_SQ {_lib.EXP_AVG_SQ}'"]


def test_a_newer_library_that_only_adds_is_accepted():
    newer = _library().replace(
        f"struct ckpt_store_options {ctypes.sizeof(_lib.StoreOptions)}",
        f"struct ckpt_store_options {ctypes.sizeof(_lib.StoreOptions) + 8}")
    newer = newer.replace(f"const CKPT_ABI_VERSION {_lib.ABI_VERSION}",
                          f"const CKPT_ABI_VERSION {_lib.ABI_VERSION + 1}")
    newer += "func ckpt_something_new i32 p\nconst CKPT_SOMETHING 9\n"
    assert _lib.layout_mismatches(newer, _lib.package_layout()) == []
    # A struct without struct_size may not grow: callers could not say which size they know.
    grown = _library().replace(f"struct ckpt_group {ctypes.sizeof(_lib.Group)}",
                               f"struct ckpt_group {ctypes.sizeof(_lib.Group) + 8}")
    assert len(_lib.layout_mismatches(grown, _lib.package_layout())) == 1
