"""The layout's one rule, checked on the source: imports point down. The ground floor (naming,
policy, the options' vocabulary) imports neither mode; the eager runtime and the compiler passes
never import each other (docs/layout.md)."""
import ast
from pathlib import Path

import remat_fx

PACKAGE = Path(remat_fx.__file__).parent
GROUND = {"remat_fx.naming", "remat_fx.policy", "remat_fx.options", "remat_fx.config", "remat_fx.memory_budget",
          "remat_fx.roofline", "remat_fx.fresh_stack", "remat_fx.sizes"}


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path):
    """remat_fx modules a file imports, at the top or inside a function (late imports count too)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("remat_fx"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("remat_fx"):
            yield node.module
            # `from remat_fx import passes` names a module too
            yield from (f"{node.module}.{a.name}" for a in node.names
                        if (PACKAGE.parent / f"{node.module}.{a.name}".replace(".", "/")).is_dir())


def test_imports_point_down():
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    assert GROUND <= set(modules), GROUND - set(modules)
    wrong = []
    for name, path in sorted(modules.items()):
        for target in _imports(path):
            if name in GROUND and target not in GROUND and target != "remat_fx":
                wrong.append(f"{name} (ground floor) imports {target}")
            for a, b in (("remat_fx.runtime", "remat_fx.passes"), ("remat_fx.passes", "remat_fx.runtime")):
                if name.startswith(a) and target.startswith(b):
                    wrong.append(f"{name} imports {target}")
    assert not wrong, "imports pointing up or across (docs/layout.md):\n" + "\n".join(wrong)
