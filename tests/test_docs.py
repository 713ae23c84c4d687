"""The documentation works as written: the python code blocks of README.md and docs/*.md run (in
order, one module per page), relative links point at files that exist (and at headings that
exist), and the README's test command is what CI runs."""
import pathlib
import re
import sys
import types

import pytest
import torch

import remat_fx
from remat_fx.step import STEP

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)

MARKDOWN = [README] + sorted(DOCS.glob("*.md"))
PAGES = [p for p in MARKDOWN if BLOCK.search(p.read_text())]
CONFIG = ("memory_budget", "cost_model", "solver", "solver_time_limit")


def _id(page: pathlib.Path) -> str:
    return page.name


@pytest.mark.parametrize("page", PAGES, ids=[_id(p) for p in PAGES])
def test_doc_code_blocks_run(page):
    """Each page's blocks run in order in one fresh module (registered in sys.modules, as a script's
    __main__ is: Dynamo imports the module of a function it inlines to read its globals)."""
    torch._dynamo.reset()
    STEP.reset()
    config = {k: getattr(remat_fx.config, k) for k in CONFIG}
    module = types.ModuleType("__doc_block__")
    sys.modules[module.__name__] = module
    try:
        for i, block in enumerate(BLOCK.findall(page.read_text())):
            exec(compile(block, f"{page.name} block {i}", "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]
        for k, v in config.items():
            setattr(remat_fx.config, k, v)
        torch._dynamo.reset()
        STEP.reset()


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lower case, punctuation dropped, spaces
    to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def _anchors(page: pathlib.Path) -> set:
    seen, out = {}, set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("page", MARKDOWN, ids=[_id(p) for p in MARKDOWN])
def test_relative_links_point_at_existing_files(page):
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"^[a-z]+:", target):  # http(s):, mailto:
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            broken.append(f"{target}: no such file")
        elif anchor and where.suffix == ".md" and anchor not in _anchors(where):
            broken.append(f"{target}: no heading with that anchor in {where.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_readme_test_command_is_what_ci_runs():
    """The README's test command is .ci/run's install and test steps (less pip's -q)."""
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    steps = [re.sub(r"^pip install -q ", "pip install ", line.strip()) for line in ci
             if line.strip().startswith(("pip install", "python -m pytest"))]
    assert steps, ".ci/run has no pip install / pytest steps"
    assert " && ".join(steps) in README.read_text(), steps
