"""Signature and Param, the driver's part of the kernel ABI: what a table may hold, what its check
says, how it binds arguments given by name (and refuses them in order), and that a Module refuses
a table that is not one before it reaches the engine. No GPU: the refusals all come before the
driver is asked for anything."""
from __future__ import annotations

import re
from typing import get_args

import pytest

from memra_cuda.driver import Module, Param, Signature
from memra_cuda.driver.signature import ARG_TYPES, ArgType, arguments


def test_a_signature_of_keywords_keeps_their_order():
    sig = Signature.of(x="ptr", n="u32", scale="f32")
    assert sig.params == (Param("x", "ptr"), Param("n", "u32"), Param("scale", "f32"))
    assert sig.types == ("ptr", "u32", "f32")
    assert str(sig) == "(ptr x, u32 n, f32 scale)"


@pytest.mark.parametrize(("name", "kind", "message"), [
    ("n", "u8", "parameter 'n': unknown type 'u8'"),
    ("n", "float", "unknown type 'float'"),
    ("2n", "u32", "identifier, not '2n'"),
    ("", "u32", "identifier"),
])
def test_a_param_is_an_identifier_of_a_known_type(name, kind, message):
    with pytest.raises(ValueError, match=message):
        Param(name, kind)  # what a caller without mypy may pass


@pytest.mark.parametrize("kind", [["u32"], {"u32": 4}, {"u32"}, None, 4, b"u32"],
                         ids=["list", "dict", "set", "none", "int", "bytes"])
def test_a_param_of_a_type_that_is_no_name_is_refused_naming_the_parameter(kind):
    """A list, a dict or a set for a type met `in ARG_TYPES`'s bare "unhashable type", naming no
    parameter; it is the ValueError every unknown type is."""
    with pytest.raises(ValueError, match=f"^parameter 'n': unknown type {re.escape(repr(kind))}; use one of"):
        Param("n", kind)
    with pytest.raises(ValueError, match="parameter 'n': unknown type"):
        Signature.of(x="ptr", n=kind)


def test_every_known_type_packs_into_a_slot():
    """ArgType (what mypy checks a table against) and ARG_TYPES (what Launch packs) name the same types."""
    assert all(dtype.itemsize in (4, 8) for dtype in ARG_TYPES.values())
    assert {Param("p", kind).type for kind in ARG_TYPES} == set(ARG_TYPES)
    assert sorted(get_args(ArgType)) == sorted(ARG_TYPES)


@pytest.mark.parametrize(("types", "message"), [
    (["ptr", "f32"], "scale: parameter 'n' is u32, not f32"),
    (["ptr", "i32"], "scale: parameter 'n' is u32, not i32"),
    (["u64", "u32"], "scale: parameter 'x' is ptr, not u64"),
    (["ptr"], r"scale takes 2 parameter\(s\) \(ptr x, u32 n\), not 1: \['ptr'\]"),
    (["ptr", "u32", "u32"], r"scale takes 2 parameter\(s\) \(ptr x, u32 n\), not 3"),
])
def test_check_names_the_kernel_and_the_first_parameter_that_differs(types, message):
    sig = Signature.of(x="ptr", n="u32")
    with pytest.raises(TypeError, match=message):
        sig.check("scale", types)
    sig.check("scale", ["ptr", "u32"])  # the declared types pass


SPEC_X = Signature.of(a="ptr", k="u32", B="u32")


def test_bind_takes_names_in_any_order_to_the_signatures_order():
    assert SPEC_X.bind("spec_x", {"B": 8, "a": 0x1000, "k": 4}) == (0x1000, 4, 8)
    assert SPEC_X.bind("spec_x", {"a": 0x1000, "k": 4, "B": 8}) == (0x1000, 4, 8)


@pytest.mark.parametrize(("values", "message"), [
    ({"a": 0, "k": 4}, r"spec_x\(ptr a, u32 k, u32 B\): missing B$"),
    ({"a": 0, "k": 4, "b": 8}, r"spec_x\(ptr a, u32 k, u32 B\): missing B; no parameter b$"),
    ({"a": 0, "k": 4, "B": 8, "n": 1}, r"spec_x\(ptr a, u32 k, u32 B\): no parameter n$"),
    ({}, r"missing a, k, B$"),
])
def test_bind_refuses_a_missing_name_and_one_the_signature_does_not_have(values, message):
    """A misspelt name (b for B) is refused, not dropped: the message names both."""
    with pytest.raises(TypeError, match=message):
        SPEC_X.bind("spec_x", values)


def test_a_kernel_with_a_signature_refuses_its_arguments_in_order():
    """k and B swapped are two u32s: no type check can see it, so an order is not taken at all
    from a kernel that has names; by name, they land where the signature puts them."""
    with pytest.raises(TypeError, match=r"^spec_x takes its arguments by name: \(ptr a, u32 k, u32 B\)$"):
        arguments("spec_x", SPEC_X, (0x1000, 8, 4), {})
    with pytest.raises(TypeError, match="spec_x takes its arguments by name"):  # mixing both
        arguments("spec_x", SPEC_X, (0x1000,), {"k": 4, "B": 8})
    assert arguments("spec_x", SPEC_X, (), {"B": 8, "k": 4, "a": 0x1000}) == (0x1000, 4, 8)


def test_a_kernel_without_a_signature_takes_its_arguments_in_order_only():
    """A user's PTX loaded without a table: no names to bind by, so names are refused."""
    assert arguments("mine", None, (0x1000, 4, 8), {}) == (0x1000, 4, 8)
    with pytest.raises(TypeError, match=r"mine has no signature in its module's table.* not by name \(k=, B=\)"):
        arguments("mine", None, (0x1000,), {"k": 4, "B": 8})


@pytest.mark.parametrize("table", [{"scale": ("ptr", "u32")}, {"scale": Signature.of(x="ptr"), 3: Signature.of()}])
def test_a_module_refuses_a_table_that_is_not_of_signatures(table):
    """Refused before the engine is asked to load anything (no engine is given here at all)."""
    with pytest.raises(TypeError, match="signatures map kernel names to Signatures"):
        Module(None, ".version 8.0\n", signatures=table)


@pytest.mark.parametrize("table", [[Signature.of(x="ptr")], [("scale", Signature.of(x="ptr"))],
                                   Signature.of(x="ptr"), "scale"], ids=["signatures", "pairs", "signature", "str"])
def test_a_module_refuses_a_table_that_is_no_mapping_naming_what_it_wants(table):
    """Module(engine, ptx, signatures=[...]) and Module.declare([...]) met "'list' object has no
    attribute 'items'", naming nothing; declare on a module with a table already said it had
    "another signature table", of a list. A TypeError saying a mapping of kernel names to
    Signatures is wanted, before the engine is asked to load anything (no engine here at all)."""
    wanted = r"^signatures must be a mapping of kernel names to Signatures \(\{'scale': Signature\.of\("
    with pytest.raises(TypeError, match=wanted):
        Module(None, ".version 8.0\n", signatures=table)
    table_of = {"scale": Signature.of(x="ptr", n="u32")}
    for before in ({}, table_of):
        module = object.__new__(Module)
        module.signatures, module._kernels = before, {}
        with pytest.raises(TypeError, match=wanted):
            module.declare(table)
        assert module.signatures is before
    module.declare(dict(table_of))  # the same table again: taken
    with pytest.raises(ValueError, match="has another signature table already"):
        module.declare({"scale": Signature.of(x="ptr")})
