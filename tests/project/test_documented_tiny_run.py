"""The documented commands that read the README's quick-start run (runs/tiny at smoke size),
smoke-run on one such run (tests/project/documented.py), and docs/decoding.md's Python example."""

from __future__ import annotations

import pytest

from tests.project import smoke_runners
from tests.project.documented import ROOT
from tests.project.smoke import smoke_entries


@pytest.mark.subprocess
@pytest.mark.parametrize("entry", smoke_entries("tiny"))
def test_smoke(entry, request, tmp_path):
    smoke_runners.run_entry(entry, request, tmp_path)


def test_the_decoding_api_example_runs(tiny_run):
    """docs/decoding.md's Python example (`sources.open`, `DecodeOptions`, `decode.generate`),
    on the quick start's MARS run: the text generate.complete gives with the same settings."""
    from mars_jax import generate

    text = (ROOT / "docs" / "decoding.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    path = str(tiny_run / "mars")
    assert '"runs/tiny/mars"' in code
    scope: dict = {}
    exec(code.replace('"runs/tiny/mars"', repr(path)), scope)
    opened, out = scope["opened"], scope["out"]
    tokens = [t for t in out.completions()[0] if t not in opened.stop_ids]
    settings = opened.options(threshold=0.9, max_new_tokens=64)
    want = generate.complete(opened, ["What is 12 * 7?"], settings)[0]
    assert 1 <= len(out.completions()[0]) <= 64
    assert opened.tokenizer.decode(tokens) == want["text"]
