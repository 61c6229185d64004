"""Every launch of a kernel with a signature, in the package, the examples and the benchmarks,
names its arguments exactly as the signature does: read from the sources, no GPU. The launchers
run only on a GPU, where a misspelt or missing name, or arguments in order, would be refused at
the first set(); here they are caught on every machine, and so is a value spelled as another of
the kernel's parameters (B=bufs.k: a swap the names alone let through).

A launch is a `.set(...)`, or a call with arguments, of what `kernel(name).prepare(...)` made,
through the names and `self.` attributes it is assigned to, or a call of a helper that forwards
a kernel's name and its arguments (a dict) to one (FORWARDERS). A kernel's name is a literal,
either branch of a conditional, width_kernel's two widths, or what a local name is assigned; its
arguments are keywords, and `**` of a dict literal, a `dict(...)`, a local name assigned one, or
a function of the same file that returns one.
"""
from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from memra_cuda.driver.signature import Signature, arguments
from memra_cuda.kernels.signatures import SIGNATURES

from test_signatures import ROUND_TAILS  # each greedy round tail and the launches it replaces

ROOT = Path(__file__).resolve().parents[2]
# Helpers that launch the kernel they are given: its name's and its arguments' positions.
FORWARDERS = {"spread": (1, 2), "_launch": (0, 1)}
# Launched by the tests alone (tests/driver, tests/gate.py), not by any source read here.
TESTS_ONLY = {"probe_increment", "probe_spin", "probe_gate"}


class Unresolved(Exception):
    """What the sources do not say statically: the message says where and what."""


class Source:
    """One file's syntax tree, with what resolving a launch asks of it."""

    def __init__(self, path: Path):
        self.path = path
        self.tree = ast.parse(path.read_text(encoding="utf-8"))
        self.parent = {child: node for node in ast.walk(self.tree) for child in ast.iter_child_nodes(node)}
        self.table = {**SIGNATURES, **own_table(self.tree)}
        self.functions = [node for node in ast.walk(self.tree) if isinstance(node, ast.FunctionDef)]
        self.attributes: dict[str, list[ast.expr]] = {}  # self.<attr> = value, anywhere in the file
        for assign in ast.walk(self.tree):
            for target in assign.targets if isinstance(assign, ast.Assign) else ():
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                        and target.value.id == "self":
                    self.attributes.setdefault(target.attr, []).append(assign.value)
        self._assigns: dict[ast.AST, dict[str, list[ast.expr]]] = {}

    def where(self, node: ast.AST) -> str:
        path = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path.name
        return f"{path}:{getattr(node, 'lineno', '?')}"

    def scopes(self, node: ast.AST) -> Iterator[ast.AST]:
        """The functions around `node`, innermost first, then the module."""
        while node in self.parent:
            node = self.parent[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
                yield node

    def assigned(self, name: ast.Name) -> list[ast.expr] | None:
        """The values assigned to `name` in the innermost scope that assigns it; None where it is
        a parameter of the function around it (what it holds is the callers' to say)."""
        for scope in self.scopes(name):
            if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                    name.id in {arg.arg for arg in (*scope.args.posonlyargs, *scope.args.args,
                                                    *scope.args.kwonlyargs)}:
                return None
            values = self.assigns(scope).get(name.id)
            if values:
                return values
        return []

    def assigns(self, scope: ast.AST) -> dict[str, list[ast.expr]]:
        """Each name assigned in `scope` (its nested functions too) -> the values assigned."""
        if scope not in self._assigns:
            found: dict[str, list[ast.expr]] = {}
            for node in ast.walk(scope):
                for target in node.targets if isinstance(node, ast.Assign) else ():
                    for name, value in _unpacked(target, node.value):
                        found.setdefault(name, []).append(value)
            self._assigns[scope] = found
        return self._assigns[scope]

    def values_of(self, node: ast.expr) -> list[ast.expr] | None:
        """What a local name or a `self.` attribute stands for; None for anything else."""
        if isinstance(node, ast.Name):
            return self.assigned(node) or None
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            return self.attributes.get(node.attr, [])
        return None

    def launched(self, node: ast.expr, seen: frozenset = frozenset()) -> set[str] | None:
        """The kernels `node` may be a Launch of (kernel(name).prepare(...), a set() of one, a
        name assigned one); None where it is no launch."""
        if id(node) in seen:
            return None
        seen |= {id(node)}
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "prepare":
                return self.kernel(node.func.value, seen)
            if node.func.attr == "set":
                return self.launched(node.func.value, seen)
            return None
        values = self.values_of(node)
        found = [kernels for value in values or () if (kernels := self.launched(value, seen)) is not None]
        return set().union(*found) if found else None

    def kernel(self, node: ast.expr, seen: frozenset) -> set[str] | None:
        """The kernels `node` may be (module.kernel(name), a name assigned one); None for no kernel."""
        if id(node) in seen:
            return None
        seen |= {id(node)}
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "kernel" \
                and node.args:
            return self.names(node.args[0])
        found = [kernels for value in self.values_of(node) or () if (kernels := self.kernel(value, seen)) is not None]
        return set().union(*found) if found else None

    def names(self, node: ast.expr) -> set[str]:
        """The kernel names `node` may hold."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, ast.IfExp):
            return self.names(node.body) | self.names(node.orelse)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "width_kernel":
            return {name for base in self.names(node.args[0]) for name in (base, f"{base}_t64")}
        if isinstance(node, ast.Name) and (values := self.assigned(node)):
            return set().union(*(self.names(value) for value in values))
        raise Unresolved(f"{self.where(node)}: cannot tell the kernel {ast.unparse(node)} names")

    def keys(self, node: ast.expr) -> dict[str, ast.expr | None]:
        """The names (and where written here, the values) of `**node`."""
        if isinstance(node, ast.Dict):
            found: dict[str, ast.expr | None] = {}
            for key, value in zip(node.keys, node.values):
                if key is None:
                    found.update(self.keys(value))
                elif isinstance(key, ast.Constant) and isinstance(key.value, str):
                    found[key.value] = value
                else:
                    raise Unresolved(f"{self.where(node)}: a key that is not a literal, {ast.unparse(key)}")
            return found
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict" and not node.args:
            return self.keywords(node)
        if isinstance(node, ast.Name) and (values := self.assigned(node)):
            return self.agreed(node, [self.keys(value) for value in values])
        if isinstance(node, ast.Call):  # a function of this file returning a dict
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            returned = [ret.value for function in self.functions if function.name == name
                        for ret in ast.walk(function) if isinstance(ret, ast.Return) and ret.value is not None]
            if returned:
                return self.agreed(node, [self.keys(value) for value in returned])
        raise Unresolved(f"{self.where(node)}: cannot tell the names of **{ast.unparse(node)}")

    def keywords(self, call: ast.Call) -> dict[str, ast.expr | None]:
        found: dict[str, ast.expr | None] = {}
        for keyword in call.keywords:
            if keyword.arg is None:
                found.update(self.keys(keyword.value))
            else:
                found[keyword.arg] = keyword.value
        return found

    def agreed(self, node: ast.expr, options: list[dict[str, ast.expr | None]]) -> dict[str, ast.expr | None]:
        """The names every option gives alike; their values where there is one option."""
        if any(option.keys() != options[0].keys() for option in options):
            raise Unresolved(f"{self.where(node)}: {ast.unparse(node)} gives other names on other paths")
        return options[0] if len(options) == 1 else {name: None for name in options[0]}


def _unpacked(target: ast.expr, value: ast.expr) -> list[tuple[str, ast.expr]]:
    """The (name, value) pairs an assignment `target = value` makes: a name's, or each of a
    tuple's where both sides are tuples."""
    if isinstance(target, ast.Name):
        return [(target.id, value)]
    if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
        return [pair for sub, sub_value in zip(target.elts, value.elts) for pair in _unpacked(sub, sub_value)]
    return []


def own_table(tree: ast.Module) -> dict[str, Signature]:
    """A file's own table (examples/own_kernels.py's): `SIGNATURES = {"name": Signature.of(...)}`."""
    table = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) \
                and any(isinstance(target, ast.Name) and target.id == "SIGNATURES" for target in node.targets):
            for key, value in zip(node.value.keys, node.value.values):
                assert isinstance(key, ast.Constant) and isinstance(value, ast.Call), ast.unparse(node)
                table[key.value] = Signature.of(**{kw.arg: kw.value.value for kw in value.keywords})
    return table


def sources() -> list[Path]:
    paths = sorted([*(ROOT / "memra_cuda").rglob("*.py"), *(ROOT / "examples").glob("*.py"),
                    *(ROOT / "benchmarks").glob("*.py")])
    if not paths or not (ROOT / "examples").is_dir():
        pytest.skip(f"no sources at {ROOT} (an installed package, not a checkout)")
    return paths


def forwarder(call: ast.Call) -> tuple[ast.expr, ast.expr] | None:
    """A forwarder's kernel name and arguments, where `call` calls one."""
    name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", None)
    if name not in FORWARDERS:
        return None
    at_name, at_args = FORWARDERS[name]
    return call.args[at_name], call.args[at_args]


def inside_a_forwarder(source: Source, call: ast.Call) -> bool:
    """A forwarder launches (or forwards) the kernel and arguments it is given: its callers' are
    checked instead."""
    scope = next(source.scopes(call))
    return isinstance(scope, ast.FunctionDef) and scope.name in FORWARDERS


def launches(source: Source) -> Iterator[tuple[ast.Call, set[str], dict[str, ast.expr | None], bool]]:
    """Each launch of the file: the call, its kernels, its arguments by name, and whether it also
    gave any in order."""
    for call in ast.walk(source.tree):
        if not isinstance(call, ast.Call) or not (call.args or call.keywords):
            continue
        try:
            forwarded = forwarder(call)
            if forwarded is not None:
                name, args = forwarded
                yield call, source.names(name), source.keys(args), False
                continue
            func = call.func
            kernels = source.launched(func.value if isinstance(func, ast.Attribute) and func.attr == "set" else func)
            if kernels is not None:
                yield call, kernels, source.keywords(call), bool(call.args)
        except Unresolved:
            if not inside_a_forwarder(source, call):
                raise


def problems_of(source: Source) -> tuple[list[str], set[str]]:
    """What is wrong with the file's launches, and the kernels they launch."""
    problems, launched = [], set()
    try:
        for call, kernels, named, positional in launches(source):
            launched |= kernels
            for kernel in sorted(kernels):
                signature = source.table.get(kernel)
                if signature is None:
                    problems.append(f"{source.where(call)}: {kernel} has no signature in the table")
                    continue
                params = [param.name for param in signature.params]
                try:  # Launch.set's own binding: nothing in order, every name the signature's and no other
                    arguments(kernel, signature, (None,) * positional, dict.fromkeys(named))
                except TypeError as exc:
                    problems.append(f"{source.where(call)}: {exc}")
                problems += [f"{source.where(call)}: {kernel}: {name}={ast.unparse(value)} is a value spelled as "
                             f"its parameter {other}" for name, value in named.items()
                             if (other := swapped(name, value, params)) is not None]
    except Unresolved as exc:
        problems.append(str(exc))
    return problems, launched


def swapped(name: str, value: ast.expr | None, params: list[str]) -> str | None:
    """The other parameter the value given for `name` is spelled as (B=k or B=bufs.k: k), taken
    for a swap; None where it is spelled as none, or as a word of `name` itself
    (mask_words=nodes.words: the toy kernels' own `words` are a recurrent state's)."""
    spelled = value.id if isinstance(value, ast.Name) else \
        value.attr if isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name) else None
    return spelled if spelled in params and spelled not in (name, *name.split("_")) else None


def test_every_launch_names_its_arguments_as_the_signature_does():
    problems, launched = [], set()
    for path in sources():
        found, kernels = problems_of(Source(path))
        problems += found
        launched |= kernels
    assert not problems, "\n".join(problems)
    unread = set(SIGNATURES) - TESTS_ONLY - launched
    assert not unread, f"kernels of the table no launch read here launches (a launch this test cannot see?): {unread}"


SWAPPED = '''
from memra_cuda.kernels.signatures import load

def launch(engine, bufs):
    return load(engine, "spec_stream").kernel("spec_state_copy").prepare(grid=1).set(
        table=bufs.table, n_entries=1, B=bufs.k, k=bufs.batch, ctl_d=bufs.ctl_d)
'''


@pytest.mark.parametrize(("text", "problem"), [
    (SWAPPED, "spec_state_copy: B=bufs.k is a value spelled as its parameter k"),
    (SWAPPED.replace("B=bufs.k", "b=bufs.k"), "missing B; no parameter b"),
    (SWAPPED.replace("table=bufs.table, n_entries=1,", "bufs.table, 1,"),
     "spec_state_copy takes its arguments by name"),
    ('''
def spread(module, name, args):
    return module.kernel(name).prepare().set(**args)

def prepare(module, bufs):
    kernel = "spec_state_flip" if bufs.flip else "spec_state_copy"
    return spread(module, kernel, dict(idx_ptrs=bufs.table, n_ptrs=1, B=bufs.batch, k=bufs.k, ctl_d=bufs.ctl_d))
''', "spec_state_copy(ptr table, u32 n_entries, u32 B, u32 k, ptr ctl_d): missing table, n_entries; "
     "no parameter idx_ptrs, n_ptrs"),
    ('''
def prepare(module, bufs, name):
    return module.kernel(name).prepare().set(x=bufs.x)
''', "cannot tell the kernel name names"),
])
def test_the_reading_catches_a_swap_a_misspelling_an_order_and_what_it_cannot_tell(tmp_path, text, problem):
    """The checks themselves, on made-up launchers."""
    path = tmp_path / "launcher.py"
    path.write_text(text, encoding="utf-8")
    found, _ = problems_of(Source(path))
    assert any(problem in line for line in found), found


def test_a_round_tail_passes_what_the_launches_it_replaces_pass():
    """The greedy round tails' launchers give each parameter the value the accept's, the commit's
    or the rollback's launcher gives it, spelled alike (ring_cap=bufs.ring_cap, n_ptrs=table_d.len,
    B=bufs.batch): the GPU tests compare the tail with those launches, but only through the
    launchers' own buffers, so a value wired to another buffer of the same size would pass them."""
    if not (ROOT / "examples").is_dir():
        pytest.skip(f"no sources at {ROOT} (an installed package, not a checkout)")
    given: dict[str, dict[str, set[str]]] = {}
    for path in (ROOT / "memra_cuda" / "kernels" / "spec.py", ROOT / "memra_cuda" / "kernels" / "tree.py"):
        for _, kernels, named, _ in launches(Source(path)):
            for kernel in kernels:
                for name, value in named.items():
                    if value is not None:
                        given.setdefault(kernel.removesuffix("_t64"), {}).setdefault(name, set()).add(
                            ast.unparse(value))
    for tail, parts in ROUND_TAILS.items():
        assert tail in given, f"no launch of {tail} found"
        for name, spelled in given[tail].items():
            theirs = set().union(*(given[part].get(name, set()) for part in parts))
            assert theirs, f"{tail}: {name} is no parameter its parts are given"
            assert spelled == theirs, f"{tail}: {name}={spelled}, its parts pass {name}={theirs}"
