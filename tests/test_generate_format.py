"""The plain-text output of ``python -m mars_jax.generate`` (no model: `complete` is stubbed)."""

import textwrap

import pytest

from mars_jax import generate

from conftest import run_python

RESULTS = [
    {"prompt": "What is 12 * 7?", "tokens": [1], "text": "84\nso 84", "tokens_per_forward": 1.0},
    {"prompt": "Two\nlines", "tokens": [], "text": "", "tokens_per_forward": 0.0},
    {"prompt": "Tom?", "tokens": [2], "text": "7", "tokens_per_forward": 1.0},
]


def test_several_completions_are_separated_and_headed():
    out = generate.format_text(RESULTS)
    assert out == (
        "=== [0] 'What is 12 * 7?' ===\n84\nso 84\n\n"
        "=== [1] 'Two\\nlines' ===\n\n\n"  # the empty completion: an empty line, then the gap
        "=== [2] 'Tom?' ===\n7"
    )
    # A single completion is printed as it is.
    assert generate.format_text(RESULTS[:1]) == "84\nso 84"


@pytest.mark.subprocess
def test_the_cli_prints_the_formatted_text(tmp_path):
    # generate.main with complete() stubbed: the CLI path prints format_text's output.
    script = textwrap.dedent(
        f"""
        import sys
        from mars_jax import generate
        generate.complete = lambda workdir, prompts, **kw: {RESULTS!r}[: len(prompts)]
        sys.argv = ["generate", "--workdir={tmp_path}", "--prompt=a", "--prompt=b", "--prompt=c"]
        generate.main()
        """
    )
    proc = run_python("-c", script)
    assert proc.stdout == generate.format_text(RESULTS) + "\n"
