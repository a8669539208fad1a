"""The package's import layers: one idea per module, imports pointing one way.

`LAYERS` is the one table of the layers, lowest first. A module of mars_jax/ may import (at the
top of the file or inside a function, in any form: ``import mars_jax.x``, ``from mars_jax import
x``, ``from mars_jax.x import y``, relative imports) only modules of strictly lower layers, never
one of its own layer or above. The test reads the sources with `ast`; nothing is imported.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mars_jax"

# (layer, modules), lowest first. The letters split one layer of the design where a module
# needs another of that layer: each sub-layer is a layer of its own.
LAYERS = (
    ("0a", ("errors", "platforms", "common_types")),
    ("0b", ("storage",)),
    (
        "0c",
        (
            "tokenizer",
            "synthetic",
            "grading",
            "metrics",
            "plots",
            "distributed",
            "attention",
            "decode_options",
            "openai_protocol",
        ),
    ),
    ("1a", ("sharding", "detokenizer")),
    ("1b", ("config",)),
    ("2a", ("kv_cache",)),
    ("2b", ("model",)),
    ("3", ("objectives",)),
    ("4a", ("rows", "chat", "vocab")),
    ("4b", ("batches",)),
    ("5", ("train_step",)),
    ("6a", ("checkpoints",)),
    ("6b", ("workdir", "huggingface")),
    ("6c", ("sources",)),
    ("7a", ("decode",)),
    ("7b", ("engine",)),
    ("8a", ("settings",)),
    ("8b", ("cli",)),
    ("8c", ("train", "evaluate", "generate", "export", "lm_eval_adapter", "serve")),
)
RANK = {module: rank for rank, (_, modules) in enumerate(LAYERS) for module in modules}
NAME = {module: name for name, modules in LAYERS for module in modules}


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


def layer_violations(module: str, source: str) -> list[str]:
    """One message per import of ``module`` (whose text is ``source``) that does not point to a
    strictly lower layer of `LAYERS`."""
    problems = []
    for line, target, text in package_imports(source):
        where = f"mars_jax/{module}.py:{line}: {text!r}"
        if target not in RANK:
            problems.append(f"{where} imports mars_jax.{target}, which is in no layer of LAYERS")
        elif RANK[target] >= RANK[module]:
            problems.append(
                f"{where}: {module} (layer {NAME[module]}) imports {target} (layer "
                f"{NAME[target]}); imports must point to a strictly lower layer"
            )
    return problems


def test_every_module_has_one_layer():
    listed = [m for _, modules in LAYERS for m in modules]
    assert len(listed) == len(set(listed)), "a module is listed in two layers"
    modules = package_modules()
    assert sorted(listed) == modules, (
        f"not in LAYERS: {sorted(set(modules) - set(listed))}; "
        f"in LAYERS but not in mars_jax/: {sorted(set(listed) - set(modules))}"
    )


@pytest.mark.parametrize("module", package_modules())
def test_imports_point_to_lower_layers(module):
    problems = layer_violations(module, (PACKAGE / f"{module}.py").read_text())
    assert not problems, "\n".join(problems)


def test_package_init_imports_nothing_of_the_package():
    assert package_imports((PACKAGE / "__init__.py").read_text()) == []


@pytest.mark.parametrize(
    "source, bad",
    [
        ("from mars_jax import decode\n", "decode"),
        ("from mars_jax.train import train\n", "train"),
        ("import mars_jax.objectives as o\n", "objectives"),
        ("def f():\n    from mars_jax import sharding, cli\n", "cli"),
        ("from . import batches\n", "batches"),
        ("from .decode import generate\n", "decode"),
        ("from mars_jax import nonexistent\n", "nonexistent"),
    ],
)
def test_a_wrong_way_import_is_reported_with_file_and_line(source, bad):
    # model (layer 2b) may import sharding (1) but none of these.
    problems = layer_violations("model", source)
    assert len(problems) == 1 and f"mars_jax/model.py:{source.count(chr(10))}:" in problems[0]
    assert bad in problems[0]
    assert layer_violations("model", "from mars_jax import sharding, attention\n") == []
