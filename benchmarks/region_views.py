"""Checkpoint regions whose outputs are views (blocks ending in a Linear over a 3-d input): the
step's measured peak on the eager tape and compiled (both lowerings), and what the plan saves.
docs/compiler.md (the tag pass) quotes it: `python benchmarks/region_views.py`."""
import torch, os, sys
os.environ["REMAT_FX_PLAN_CACHE"]="0"
import remat_fx as remat
from remat_fx.measure import step_peak_bytes
class Block(torch.nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
    def forward(self, x):
        return self.down(torch.relu(self.up(x)))
torch.manual_seed(0)
blocks = torch.nn.ModuleList([Block() for _ in range(8)])
def step(x):
    for i, block in enumerate(blocks):
        x = remat.checkpoint(f"b{i}")(block)(x)
    return x.square().sum()
x = torch.randn(8, 64, 64, requires_grad=True)
def eager():
    blocks.zero_grad(set_to_none=True); step(x).backward()
print("eager tape peak", step_peak_bytes(eager))
for lower in ("eager", "inductor"):
    torch._dynamo.reset()
    c = torch.compile(step, backend="remat", options={"lower": lower}, fullgraph=True)
    def s():
        blocks.zero_grad(set_to_none=True); c(x).backward()
    s(); s()
    p = remat.last_plan()
    print(lower, "saved", p.total_bytes, "est", p.peak.step, "measured", step_peak_bytes(s))
