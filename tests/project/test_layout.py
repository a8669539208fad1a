"""The package's wings: one idea per module, imports pointing one way.

`WINGS` is the one table of the package's architecture, lowest wing first; docs/architecture.md
and the README's module map show the same rows. A module of mars_jax/ may import (at the top of
the file or inside a function, in any form: ``import mars_jax.x``, ``from mars_jax import x``,
``from mars_jax.x import y``, relative imports) only modules of its own wing or of lower wings,
and the imports between the package's modules form no cycle, so inside a wing too they point
one way. The test reads the sources with `ast`; nothing is imported. tests/ has one folder per
wing (and project/ for the repository as a whole).
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "mars_jax"

# (wing, its modules), lowest wing first.
WINGS = (
    ("base", ("errors", "platforms", "common_types", "storage", "distributed", "metrics", "plots")),
    (
        "data",
        (
            "synthetic",
            "grading",
            "tokenizer",
            "detokenizer",
            "rows",
            "chat_rows",
            "vocab",
            "packing",
            "batches",
        ),
    ),
    ("model", ("sharding", "attention", "kv_cache", "model", "huggingface")),
    ("config", ("decode_options", "config")),
    ("training", ("objectives", "train_step", "checkpoints", "workdir")),
    ("decoding", ("sources", "acceptance", "decode_state", "decoder", "decode", "engine")),
    (
        "programs",
        (
            "cli",
            "openai_protocol",
            "train_inputs",
            "train",
            "evaluate",
            "generate",
            "distill",
            "chat",
            "export",
            "lm_eval_adapter",
            "serve_metrics",
            "openai_adapter",
            "serve",
        ),
    ),
)
RANK = {module: rank for rank, (_, modules) in enumerate(WINGS) for module in modules}
WING = {module: wing for wing, modules in WINGS for module in modules}


def package_modules() -> list[str]:
    return sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")


def package_imports(source: str) -> list[tuple[int, str, str]]:
    """(line, mars_jax module imported, the import as written) for every import of a mars_jax
    module in ``source`` (a module of mars_jax/), at any depth."""
    found = []
    for node in ast.walk(ast.parse(source)):
        text = ast.unparse(node) if isinstance(node, (ast.Import, ast.ImportFrom)) else ""
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "mars_jax" and len(parts) > 1:
                    found.append((node.lineno, parts[1], text))
        elif isinstance(node, ast.ImportFrom):
            parts = (node.module or "").split(".") if node.module else []
            if node.level:  # relative to mars_jax/: "from . import x", "from .x import y"
                parts = ["mars_jax"] + parts
            if not parts or parts[0] != "mars_jax":
                continue
            if len(parts) > 1:
                found.append((node.lineno, parts[1], text))
            else:  # from mars_jax import x, y
                found += [(node.lineno, alias.name, text) for alias in node.names]
    return found


def wing_violations(module: str, source: str) -> list[str]:
    """One message per import of ``module`` (whose text is ``source``) of a module in a higher
    wing of `WINGS`, or in none."""
    problems = []
    for line, target, text in package_imports(source):
        where = f"mars_jax/{module}.py:{line}: {text!r}"
        if target not in RANK:
            problems.append(f"{where} imports mars_jax.{target}, which is in no wing of WINGS")
        elif RANK[target] > RANK[module]:
            problems.append(
                f"{where}: {module} (wing {WING[module]}) imports {target} (wing "
                f"{WING[target]}); imports must point to the same wing or a lower one"
            )
    return problems


def import_cycle(graph: dict[str, set[str]]) -> list[str]:
    """A cycle of ``graph`` (module -> the modules it imports) as [a, b, ..., a]; [] if none."""
    state: dict[str, str] = {}  # "open" while on the path, "done" after

    def visit(node: str, path: list[str]) -> list[str]:
        state[node] = "open"
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return path[path.index(target) :] + [target]
            if target not in state and (found := visit(target, path + [target])):
                return found
        state[node] = "done"
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node, [node])):
            return found
    return []


def package_graph() -> dict[str, set[str]]:
    return {
        m: {t for _, t, _ in package_imports((PACKAGE / f"{m}.py").read_text())} - {m}
        for m in package_modules()
    }


def test_every_module_has_one_wing():
    listed = [m for _, modules in WINGS for m in modules]
    assert len(listed) == len(set(listed)), "a module is listed in two wings"
    modules = package_modules()
    assert sorted(listed) == modules, (
        f"not in WINGS: {sorted(set(modules) - set(listed))}; "
        f"in WINGS but not in mars_jax/: {sorted(set(listed) - set(modules))}"
    )


@pytest.mark.parametrize("module", package_modules())
def test_imports_point_to_the_same_or_a_lower_wing(module):
    problems = wing_violations(module, (PACKAGE / f"{module}.py").read_text())
    assert not problems, "\n".join(problems)


def test_the_imports_form_no_cycle():
    cycle = import_cycle(package_graph())
    assert not cycle, "mars_jax imports in a cycle: " + " -> ".join(cycle)


def test_a_cycle_is_found_and_named():
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert import_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_package_init_imports_nothing_of_the_package():
    assert package_imports((PACKAGE / "__init__.py").read_text()) == []


def test_tests_have_one_folder_per_wing():
    folders = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and p.name[0] != "_"}
    assert {wing for wing, _ in WINGS} <= folders
    assert folders - {wing for wing, _ in WINGS} == {"project", "multidevice"}
    assert not list((ROOT / "tests").glob("test_*.py")), "a test file outside a wing folder"


@pytest.mark.parametrize(
    "source, bad",
    [
        ("from mars_jax import decode\n", "decode"),
        ("from mars_jax.train import train\n", "train"),
        ("import mars_jax.objectives as o\n", "objectives"),
        ("def f():\n    from mars_jax import sharding, cli\n", "cli"),
        ("from . import workdir\n", "workdir"),
        ("from .decode import generate\n", "decode"),
        ("from mars_jax import nonexistent\n", "nonexistent"),
    ],
)
def test_a_wrong_way_import_is_reported_with_file_and_line(source, bad):
    # model (wing model) may import sharding (model) and errors (base), but none of these.
    problems = wing_violations("model", source)
    assert len(problems) == 1 and f"mars_jax/model.py:{source.count(chr(10))}:" in problems[0]
    assert bad in problems[0]
    assert wing_violations("model", "from mars_jax import sharding, errors\n") == []
