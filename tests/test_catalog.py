"""The algorithm catalog (csrc/backend/algorithm_catalog.cc) is the one place an algorithm is
declared: its name, its collective, its needs and what runs instead. Everything else derives its
lists from torch_torus._C's export of it, so adding an algorithm in one place only fails here."""

from __future__ import annotations

import ast
import math
import re
from pathlib import Path

import pytest

from torch_torus import algorithms, config, cost_model, selection

ROOT = Path(__file__).resolve().parent.parent
# The sources where an allreduce algorithm's name may stand as a string: its declaration in
# the catalog, and its cost in the cost model.
NAME_HOMES = {"csrc/backend/algorithm_catalog.cc", "torch_torus/cost_model.py"}
# "torus" is also the backend's name: C++ returns it to c10d (getBackendName). In Python it stands
# as the backend's name where it is compared with, or passed as, a backend (see _backend_names).
BACKEND_NAME_HOMES = {"csrc/backend/process_group_torus.h"}
BACKEND_NAME = "torus"
CPP_SUFFIXES = {".h", ".cc", ".cpp", ".cu", ".cuh"}
_CPP_LITERAL = re.compile(r'"((?:[^"\\\n]|\\.)*)"')


def _cpp_code(text: str) -> str:
    """The text without // and /* */ comments (string literals kept whole)."""
    return re.sub(r'"(?:[^"\\\n]|\\.)*"|//[^\n]*|/\*.*?\*/',
                  lambda m: m.group(0) if m.group(0).startswith('"') else " ", text, flags=re.S)


def _mentions_backend(node: ast.AST) -> bool:
    return "backend" in ast.unparse(node).lower()


def _backend_names(tree: ast.AST) -> set[int]:
    """The ids of the "torus" constants that name the backend: compared with a backend
    (contender.backend == "torus", "torus" in backend), passed as one (backend="torus",
    init_process_group("torus")), the default of a parameter or an option named backend
    (add_argument("--backend", default="torus"), add_argument("--backends", default=["torus", "gloo"])),
    or BACKEND_NAME's value."""
    found = set()

    def mark(node):
        if isinstance(node, ast.Constant) and node.value == BACKEND_NAME:
            found.add(id(node))
        elif isinstance(node, (ast.List, ast.Tuple)):
            for element in node.elts:
                mark(element)

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(map(_mentions_backend, [node.left, *node.comparators])):
            for operand in [node.left, *node.comparators]:
                mark(operand)
        elif isinstance(node, ast.keyword) and node.arg == "backend":
            mark(node.value)
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith(("init_process_group", "new_group")):
            for argument in node.args[:1]:
                mark(argument)
        elif isinstance(node, ast.Call) and any(map(_mentions_backend, node.args)):
            for keyword in node.keywords:
                if keyword.arg == "default":
                    mark(keyword.value)
        elif isinstance(node, ast.arguments):
            positional = node.posonlyargs + node.args
            for argument, default in zip(positional[len(positional) - len(node.defaults):], node.defaults):
                if argument.arg == "backend":
                    mark(default)
        elif isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "BACKEND_NAME" for t in node.targets):
            mark(node.value)
    return found


def string_literals(path: Path) -> set[str]:
    """The strings written in a source file, less comments, docstrings' surroundings and the
    backend's name where it names the backend."""
    text = path.read_text()
    if path.suffix == ".py":
        tree = ast.parse(text)
        backend = _backend_names(tree)
        return {node.value for node in ast.walk(tree)
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in backend}
    return set(_CPP_LITERAL.findall(_cpp_code(text)))


def source_files() -> list[Path]:
    files = [p for p in (ROOT / "csrc").rglob("*") if p.suffix in CPP_SUFFIXES]
    files += list((ROOT / "torch_torus").rglob("*.py")) + list((ROOT / "benchmarks").rglob("*.py"))
    return sorted(files)


def test_allreduce_names_stand_in_the_catalog_and_the_cost_model_only():
    names = set(algorithms.ALLREDUCE)
    assert len(NAME_HOMES) <= 3
    found = {}
    for path in source_files():
        relative = str(path.relative_to(ROOT))
        named = string_literals(path) & names
        if relative in BACKEND_NAME_HOMES:
            named.discard("torus")
        if named and relative not in NAME_HOMES:
            found[relative] = sorted(named)
    assert not found, (f"allreduce algorithm names written outside the catalog and the cost model: {found}; "
                       "take them from torch_torus.algorithms (C++: algorithm_catalog.h)")


def test_the_cost_model_describes_catalog_algorithms_only():
    assert set(cost_model._ALLREDUCE_STEPS) <= set(algorithms.ALLREDUCE)


@pytest.mark.parametrize("algorithm", algorithms.ALLREDUCE)
def test_every_allreduce_algorithm_has_a_cost(algorithm):
    seconds = cost_model.allreduce_seconds(algorithm, 1 << 20, 4, grid_shape=(2, 2))
    assert math.isfinite(seconds) and seconds > 0


def test_every_fallback_is_an_algorithm_of_the_same_collective():
    for entry in algorithms.CATALOG:
        for requirement in entry.needs:
            algorithms.entry(entry.collective, requirement.instead)
            assert requirement.need in {"grid", "shared_memory", "single_copy", "fits_slot"}


def test_the_name_check_sees_a_name_written_anywhere(tmp_path):
    stray = tmp_path / "stray.py"
    stray.write_text('FAST = "one_shot"\nif args.backend == "torus":\n    pass\nRULE = ("torus", 0)\n')
    assert string_literals(stray) & set(algorithms.ALLREDUCE) == {"one_shot", "torus"}
    cpp = tmp_path / "stray.cc"
    cpp.write_text('// "ring" in a comment\nconst char* name = "two_shot";\n')
    assert string_literals(cpp) & set(algorithms.ALLREDUCE) == {"two_shot"}


def test_settings_and_selection_take_their_lists_from_the_catalog():
    assert config.ALGORITHMS == algorithms.CHOOSABLE
    assert config.TORUS_INNER_ALGORITHMS == algorithms.TORUS_INNER
    over_tcp = selection.allreduce_candidates(None, "tcp")
    assert set(over_tcp) == set(algorithms.ALLREDUCE) - set(algorithms.SHARED_MEMORY) - set(algorithms.NEEDS_GRID)
