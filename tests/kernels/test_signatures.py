"""The kernel ABI: memra_cuda.kernels.signatures.SIGNATURES is what ptx/*.cu declares, kernel by
kernel, names and types, every kernel present both ways (read from the sources by a small parser
of their `extern "C" __global__` parameter lists); the launchers take their types from it;
prepare refuses a type swap, naming the kernel and the parameter, before anything reaches the
driver; and a launch of a kernel of the table takes its arguments by name, so a swap of two of
one type is refused too. No GPU needed."""
from __future__ import annotations

import ast
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from memra_cuda.driver.module import Kernel, KernelArgs, Launch
from memra_cuda.kernels.signatures import SIGNATURES

ROOT = Path(__file__).resolve().parents[2]
PTX_DIR = ROOT / "ptx"

KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)')
TYPEDEF = re.compile(r"\btypedef\s+([\w\s]+?)\s+(\w+)\s*;")
INCLUDE = re.compile(r'#include\s+"([^"]+)"')
QUALIFIERS = {"const", "volatile", "__restrict__", "restrict"}
# C's scalar types as Launch packs them; any pointer is "ptr".
C_TYPES = {
    "unsigned": "u32", "unsigned int": "u32", "uint32_t": "u32",
    "int": "i32", "signed": "i32", "signed int": "i32", "int32_t": "i32",
    "unsigned long long": "u64", "unsigned long long int": "u64", "uint64_t": "u64",
    "long long": "i64", "long long int": "i64", "int64_t": "i64",
    "float": "f32", "double": "f64",
}


def without_comments(text: str) -> str:
    return re.sub(r"/\*.*?\*/|//[^\n]*", "", text, flags=re.S)


def c_type(declaration: str, typedefs: dict[str, str]) -> tuple[str, str]:
    """(name, type) of one C parameter declaration, `const float* __restrict__ p_d` say."""
    words = re.findall(r"\w+|\*", declaration)
    name, spelled = words[-1], [word for word in words[:-1] if word not in QUALIFIERS]
    if "*" in spelled:
        return name, "ptr"
    base = " ".join(spelled)
    base = typedefs.get(base, base)
    if base not in C_TYPES:
        raise ValueError(f"parameter {name!r}: no argument type for C type {base!r}")
    return name, C_TYPES[base]


def parse(text: str, headers: dict[str, str] | None = None) -> dict[str, list[tuple[str, str]]]:
    """Each `extern "C" __global__` kernel of a CUDA source -> its parameters' (name, type), with
    the typedefs of the source and the headers it includes (`headers`: name -> text) resolved."""
    text = without_comments(text)
    included = "".join(without_comments((headers or {}).get(name, "")) for name in INCLUDE.findall(text))
    typedefs = {alias: " ".join(spelled.split()) for spelled, alias in TYPEDEF.findall(included + text)}
    return {name: [c_type(param, typedefs) for param in params.split(",") if param.strip()]
            for name, params in KERNEL.findall(text)}


def sources() -> dict[str, dict[str, list[tuple[str, str]]]]:
    """ptx/<file>.cu -> its kernels' parameters."""
    headers = {path.name: path.read_text(encoding="utf-8") for path in PTX_DIR.glob("*.cuh")}
    return {path.name: parse(path.read_text(encoding="utf-8"), headers) for path in sorted(PTX_DIR.glob("*.cu"))}


def test_the_parser_reads_c_parameter_lists():
    source = """
    #include "types.cuh"
    // extern "C" __global__ void commented_out(float x) {}
    extern "C" __global__ void __launch_bounds__(256)
    k(const u32* __restrict__ a, volatile unsigned long long* b, unsigned n, int delta,
      float scale, u64 handle, const uint4* __restrict__ w, double d, long long s) {}
    """
    assert parse(source, {"types.cuh": "typedef unsigned int u32;\ntypedef unsigned long long u64;\n"}) == {
        "k": [("a", "ptr"), ("b", "ptr"), ("n", "u32"), ("delta", "i32"), ("scale", "f32"), ("handle", "u64"),
              ("w", "ptr"), ("d", "f64"), ("s", "i64")]}
    with pytest.raises(ValueError, match="'h'.*'half'"):
        parse('extern "C" __global__ void k(half h) {}')


def test_every_kernel_of_the_sources_is_parsed():
    """The parser misses none: as many kernels as `extern "C" __global__` in each source."""
    for path in sorted(PTX_DIR.glob("*.cu")):
        text = without_comments(path.read_text(encoding="utf-8"))
        assert len(KERNEL.findall(text)) == len(re.findall(r'extern\s+"C"\s+__global__', text)), path.name
    assert sum(len(kernels) for kernels in sources().values()) >= 41


def test_kernel_names_are_unique_across_the_sources():
    """One table for every module holds only while no two files define a kernel of one name."""
    names = [name for kernels in sources().values() for name in kernels]
    assert len(names) == len(set(names)), sorted(name for name in names if names.count(name) > 1)


def test_the_table_is_what_the_sources_declare():
    declared = {name: params for kernels in sources().values() for name, params in kernels.items()}
    tabled = {name: [(param.name, param.type) for param in sig.params] for name, sig in SIGNATURES.items()}
    problems = [f"{name}: in ptx/*.cu, not in SIGNATURES" for name in sorted(declared.keys() - tabled.keys())]
    problems += [f"{name}: in SIGNATURES, in no ptx/*.cu" for name in sorted(tabled.keys() - declared.keys())]
    problems += [f"{name}: the source declares {declared[name]}, the table {tabled[name]}"
                 for name in sorted(declared.keys() & tabled.keys()) if declared[name] != tabled[name]]
    assert not problems, "\n".join(problems)


def launchers() -> list[Path]:
    """Every module that loads the committed PTX through the table (signatures.load): the
    launchers of memra_cuda/kernels, the device loop's decider, the toy model, the bench."""
    paths = sorted([*(ROOT / "memra_cuda").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py")])
    return [path for path in paths
            if any(isinstance(node, ast.ImportFrom) and (node.module or "").endswith("signatures")
                   and any(alias.name == "load" for alias in node.names)
                   for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))))]


def test_the_launchers_take_their_types_from_the_table():
    """No launcher of the package's PTX spells out argument types: every prepare() of theirs
    passes grid and block alone, so the types are the table's."""
    found = launchers()
    assert {"spec.py", "sampling.py", "tree.py", "device_loop.py", "lm.py"} <= {path.name for path in found}, found
    inline = []
    for path in found:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "prepare" \
                    and (node.args or any(keyword.arg == "types" for keyword in node.keywords)):
                inline.append(f"{path.name}:{node.lineno}")
    assert not inline, f"types given inline, not from SIGNATURES: {inline}"


def kernel_without_a_driver(name: str) -> Kernel:
    """A Kernel of a module loaded with SIGNATURES, with no driver, context or engine behind it:
    anything prepare reaches past its type check fails with an AttributeError instead."""
    kernel = object.__new__(Kernel)
    kernel.module, kernel.name, kernel.handle = SimpleNamespace(signatures=SIGNATURES), name, None
    return kernel


@pytest.mark.parametrize(("kernel", "types", "message"), [
    ("spec_accept_greedy_dc", ["ptr", "ptr", "f32", "u32", "ptr", "ptr", "ptr", "ptr"],
     "spec_accept_greedy_dc: parameter 'k' is u32, not f32"),
    ("spec_accept_greedy_dc", ["ptr", "ptr", "u32", "i32", "ptr", "ptr", "ptr", "ptr"],
     "spec_accept_greedy_dc: parameter 'B' is u32, not i32"),
    ("toy_probs", ["ptr", "u32", "u32", "u32", "u32", "f32", "f32", "f32", "f32", "ptr"],
     "toy_probs: parameter 'floor' is f32, not u32"),
    ("spec_loop_decide", ["ptr", "ptr", "ptr", "u32", "ptr", "ptr", "u32", "u32", "u32"],
     "spec_loop_decide: parameter 'handle' is u64, not ptr"),
    ("probe_increment", ["ptr"], r"probe_increment takes 2 parameter\(s\) \(ptr x, u32 n\), not 1"),
])
def test_prepare_refuses_a_type_swap_naming_the_kernel_and_the_parameter(kernel, types, message):
    """Sizes cannot tell a u32 from an f32 or an i32: the signature can, and prepare asks it
    first, before the module, the engine or the driver."""
    with pytest.raises(TypeError, match=message):
        kernel_without_a_driver(kernel).prepare(types, grid=1, block=32)


def test_prepare_takes_the_tables_types_where_none_are_given():
    kernel = kernel_without_a_driver("spec_accept_greedy_dc")
    assert kernel.declared(None) == ("ptr", "ptr", "u32", "u32", "ptr", "ptr", "ptr", "ptr")
    assert kernel.declared(["ptr", "ptr", "u32", "u32", "ptr", "ptr", "ptr", "ptr"]) == kernel.declared(None)
    with pytest.raises(AttributeError):  # past the check: the stand-in module has no engine
        kernel.prepare(grid=1, block=32)


def test_a_kernel_its_modules_table_does_not_name_needs_its_types_given():
    """A user's module loaded without a table, or a kernel the table leaves out: prepare cannot
    know the arguments, so it asks for them rather than packing none."""
    kernel = kernel_without_a_driver("my_own_kernel")
    with pytest.raises(TypeError, match="my_own_kernel has no signature in its module's table: give its argument"):
        kernel.prepare(grid=1, block=32)
    assert kernel.declared(["ptr", "u32"]) == ("ptr", "u32"), "given types are taken as they are"


def launch_without_a_driver(name: str) -> Launch:
    """A Launch of `name` as prepare makes one, its arguments stored in host memory, with
    stand-ins for what set() asks of the module and the engine: the real set(), no driver."""
    kernel = kernel_without_a_driver(name)
    kernel.module.depend, kernel.module.freed = (lambda dependent: None), False
    launch = object.__new__(Launch)
    launch.kernel, launch.signature, launch.engine = kernel, kernel.signature, SimpleNamespace(closed=False)
    launch.args = KernelArgs.of_kernel(name, kernel.signature, kernel.declared(None))  # as Launch's __init__
    return launch


def test_a_launcher_refuses_two_swapped_arguments_of_one_type():
    """spec_accept_greedy_dc(ptr vtok_d, ptr pred_d, u32 k, u32 B, ...) given B where k goes and
    k where B goes: every type is right, and the kernel would judge 64 drafts of 4 rows. A kernel
    with a signature takes no order at all, so the swapped call is refused before any slot is
    written; by name, each value lands in its parameter's slot whatever order the names come in."""
    launch = launch_without_a_driver("spec_accept_greedy_dc")
    vtok, pred, brk, acc, last, ctl = (0x1000 * i for i in range(1, 7))
    k, B = 4, 64
    launch.set(vtok_d=vtok, pred_d=pred, B=B, k=k, brk_d=brk, acc_d=acc, last_pred_d=last, ctl_d=ctl)
    stored = launch.args.storage.tolist()
    assert stored == [vtok, pred, k, B, brk, acc, last, ctl]
    by_name = r"spec_accept_greedy_dc takes its arguments by name: \(ptr vtok_d, ptr pred_d, u32 k, u32 B, ptr brk_d"
    with pytest.raises(TypeError, match=by_name):
        launch.set(vtok, pred, B, k, brk, acc, last, ctl)
    with pytest.raises(TypeError, match=by_name):
        launch(vtok, pred, B, k, brk, acc, last, ctl)  # a launch called with arguments sets them first
    with pytest.raises(TypeError, match=r"spec_accept_greedy_dc\(.*\): missing B; no parameter b$"):
        launch.set(vtok_d=vtok, pred_d=pred, b=B, k=k, brk_d=brk, acc_d=acc, last_pred_d=last, ctl_d=ctl)
    assert launch.args.storage.tolist() == stored, "a refused set leaves the arguments as they were"


def test_a_refused_argument_names_the_kernel_and_the_parameter():
    """A value its parameter's type cannot hold was named by its position alone ("argument 6
    (u32)"), which the caller, who gave it by name, has to count out of the signature: it names
    the kernel and the parameter now. A bool is no u32 and no address (True was stored as 1, a
    pointer to address 1), and a float past f32 is refused by name (it raised OverflowError)."""
    launch = launch_without_a_driver("spec_ring_commit")
    good = dict(vtok_d=0x1000, acc_d=0x2000, last_pred_d=0x3000, ctl_d=0x4000, pend_d=0x5000, ring_d=0x6000,
                ring_cap=20, k=4, B=8)
    launch.set(**good)
    stored = launch.args.storage.tolist()
    refusals = [(ValueError, {"ring_cap": 2**32}, r"^spec_ring_commit: ring_cap \(u32\): 4294967296 is outside the "
                                                  r"range of uint32$"),
                (TypeError, {"k": True}, r"^spec_ring_commit: k \(u32\) must be an integer, not True$"),
                (TypeError, {"ring_d": True}, r"^spec_ring_commit: ring_d \(ptr\) is a device pointer: .* not True$"),
                (ValueError, {"B": 2.0}, r"^spec_ring_commit: B \(u32\): 2\.0 is not an integer")]
    for error, bad, message in refusals:
        with pytest.raises(error, match=message):
            launch.set(**{**good, **bad})
    chooser = launch_without_a_driver("spec_choose_lengths")
    lengths = dict(ctl_d=1, acc_d=2, brk_d=3, rate_d=4, cap_d=5, cost_d=6, width_d=7, k=4, B=8, decay=0.5, prior=0.5)
    with pytest.raises(ValueError, match=r"^spec_choose_lengths: decay \(f32\): 10{400} is outside the range of "):
        chooser.set(**{**lengths, "decay": 10**400})
    assert launch.args.storage.tolist() == stored, "a refused set leaves the arguments as they were"
    unnamed = KernelArgs(["ptr", "u32"], kernel="my_own_kernel")
    with pytest.raises(ValueError, match=r"^my_own_kernel: argument 1 \(u32\): 4294967296 is outside"):
        unnamed.set(0x1000, 2**32)


# The greedy round tails and the launches each replaces (kernels 3 or 13, 4, 5): the tail takes
# their parameters (here) and its launcher passes what theirs pass (test_named_arguments.py).
ROUND_TAILS = {"spec_round_tail_greedy": ("spec_accept_greedy_dc", "spec_ring_commit", "spec_rollback_stream"),
               "spec_tree_round_tail_greedy": ("spec_tree_accept_greedy", "spec_ring_commit", "spec_rollback_stream")}


@pytest.mark.parametrize("width", ["", "_t64"])
@pytest.mark.parametrize(("tail", "parts"), list(ROUND_TAILS.items()))
def test_a_round_tail_takes_the_parameters_of_the_launches_it_replaces(tail, parts, width):
    """Each parameter of a fused tail is one of its parts', of the same type, and each of the
    parts' is the tail's: but the commit's k, which a tree's tail reads as its depth D (its vtok
    rows are D + 1 words). Its acceptance's token width is the tail's."""
    params = {param.name: param.type for param in SIGNATURES[tail + width].params}
    of_parts: dict[str, set[str]] = {}
    for part in parts:
        for param in SIGNATURES[part + width if "accept" in part else part].params:
            of_parts.setdefault(param.name, set()).add(param.type)
    assert all(len(types) == 1 for types in of_parts.values()), of_parts
    depth_for_k = tail.startswith("spec_tree")
    assert {name: types.pop() for name, types in of_parts.items() if not (depth_for_k and name == "k")} == params


def test_a_round_tail_takes_its_arguments_by_name():
    """Fourteen arguments, five of them u32: by name each lands in its slot, in order none does."""
    launch = launch_without_a_driver("spec_round_tail_greedy_t64")
    pointers = dict(vtok_d=0x1000, pred_d=0x2000, brk_d=0x3000, acc_d=0x4000, last_pred_d=0x5000, ctl_d=0x6000,
                    pend_d=0x7000, ring_d=0x8000, len_ptrs=0x9000, pos_start_d=0xA000)
    launch.set(n_ptrs=15, ring_cap=20, B=8, k=4, **pointers)
    assert launch.args.storage.tolist() == [0x1000, 0x2000, 4, 8, 0x3000, 0x4000, 0x5000, 0x6000, 0x7000, 0x8000, 20,
                                            0x9000, 15, 0xA000]
    with pytest.raises(TypeError, match=r"spec_round_tail_greedy_t64\(.*\): missing n_ptrs; no parameter n$"):
        launch.set(n=15, ring_cap=20, B=8, k=4, **pointers)
    with pytest.raises(TypeError, match="spec_round_tail_greedy_t64 takes its arguments by name"):
        launch.set(*pointers.values())
