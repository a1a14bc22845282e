"""The package layout's one rule: the shared package (services/common, `treeserve`) imports no service package
and not the command line, which sit on top of it."""

import ast
from pathlib import Path

ABOVE_COMMON = ("treeserve.drafter", "treeserve.verifier", "treeserve.gateway", "treeserve.cli")


def test_the_shared_package_imports_no_service():
    common = Path(__file__).parent.parent / "services" / "common"
    found = []
    for path in sorted(common.rglob("*.py")):
        if path.name == "__main__.py":  # `python -m treeserve`: the command line's entry point
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(common)}: {name}" for name in names
                      if name == "treeserve" and isinstance(node, ast.ImportFrom)
                      and any(f"treeserve.{a.name}" in ABOVE_COMMON for a in node.names)
                      or name.startswith(ABOVE_COMMON)]
    assert not found, found
