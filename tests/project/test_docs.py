"""The documentation holds together: every relative link and #anchor in README.md, docs/*.md and
launch/README.md resolves (GitHub's anchor rules), every docs page is linked from the README, the README stays a
front door (at most 230 lines), and the README's module map names only modules of mars_jax/.
Fast: reads files only."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS, ROOT / "launch" / "README.md"]
MAX_README_LINES = 230

_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose(text: str) -> list[str]:
    """The lines outside fenced code blocks and HTML comments, inline code spans removed."""
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(re.sub(r"`[^`]*`", "``", line))
    return lines


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: markup dropped, lowercase, punctuation dropped (letters,
    digits, spaces, '-' and '_' stay), each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.replace("`", "").strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of ``path``'s headings, repeats numbered as GitHub does (-1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    text = re.sub(r"<!--.*?-->", "", path.read_text(), flags=re.S)
    fenced = False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        m = not fenced and re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = github_anchor(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    return [m.group(1) for line in _prose(path.read_text()) for m in _LINK.finditer(line)]


def test_github_anchor_rules():
    assert (
        github_anchor("Running on a TPU pod / GPU cluster") == "running-on-a-tpu-pod--gpu-cluster"
    )
    assert github_anchor("1. A Cloud TPU VM pod slice: `launch/tpu_vm.sh`") == (
        "1-a-cloud-tpu-vm-pod-slice-launchtpu_vmsh"
    )
    assert github_anchor("The paper's three claims at small scale") == (
        "the-papers-three-claims-at-small-scale"
    )


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_and_anchors_resolve(page):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(ROOT / "README.md")}
    assert [p.name for p in DOCS if p.resolve() not in linked] == []


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines"
    # "How it works" (with the module map) within the first screens.
    assert lines.index("## How it works") < 120


def readme_module_map() -> list[tuple[str, list[str]]]:
    """(wing, module names) of each row of the README's map between <!-- MODULE-MAP --> and
    <!-- /MODULE-MAP -->: the backticked names of its second column, parenthesized descriptions
    left out."""
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- MODULE-MAP -->", 1)[1].split("<!-- /MODULE-MAP -->", 1)[0]
    rows = []
    for row in block.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]]
        if len(cells) < 2 or set(cells[1]) <= set("-: ") or cells[0] == "wing":
            continue
        described = cells[1]
        while re.search(r"\([^()]*\)", described):
            described = re.sub(r"\([^()]*\)", "", described)
        rows.append((cells[0], re.findall(r"`([a-z_][a-z0-9_]*)`", described)))
    return rows


def test_the_readme_module_map_shows_the_wings_of_the_layout_test():
    """The README's map is `WINGS` (tests/project/test_layout.py), highest wing first."""
    from tests.project.test_layout import WINGS

    assert readme_module_map() == [(wing, list(modules)) for wing, modules in reversed(WINGS)]


def test_every_extra_the_docs_name_is_spelled_as_pip_reads_it():
    """`pip install -e ".[X]"` in the docs names an extra of the installed metadata exactly:
    setuptools records ``lm_eval`` as ``lm-eval``, and the pip that ``python3 -m venv`` brings
    (23.2) then installs nothing for ``.[lm_eval]`` and exits 0."""
    import importlib.metadata

    provided = set(importlib.metadata.metadata("mars-jax").get_all("Provides-Extra") or ())
    named = {
        extra
        for page in [*PAGES, ROOT / "tests" / "project" / "documented.py"]
        for group in re.findall(r"pip install -e [\"']?\.\[([^\]]+)\]", page.read_text())
        for extra in group.split(",")
    }
    assert named, "no extra named in the docs"
    assert named <= provided, f"named {sorted(named)}; the package provides {sorted(provided)}"
