"""The python code blocks of docs/*.md run as written."""
import pathlib
import re

import pytest
import torch

from remat_fx.step import STEP

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
PAGES = sorted(p for p in DOCS.glob("*.md") if BLOCK.search(p.read_text()))


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_doc_code_blocks_run(page):
    torch._dynamo.reset()
    STEP.reset()
    for i, block in enumerate(BLOCK.findall(page.read_text())):
        exec(compile(block, f"{page.name} block {i}", "exec"), {"__name__": "__doc_block__"})
    torch._dynamo.reset()
    STEP.reset()
