"""The package layout's rules, from the bottom up: the shared package (services/common, `treeserve`) imports no
service, nor the command line or the benches above them; a service (gateway, verifier, drafter) imports no other
service and no bench; the kernels import none of them; serving code imports no drafter training."""

import ast
from pathlib import Path

ROOT = Path(__file__).parent.parent
SERVICES = {"drafter": "services/drafter", "verifier": "services/verifier", "gateway": "services/gateway"}
BENCH, CLI, TRAINING = "treeserve.bench", "treeserve.cli", "treeserve.drafter.training"


def imported(path: Path) -> set[str]:
    """Every module a file names in an import, `from treeserve import bench` counted as treeserve.bench."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def forbidden_imports(folder: str, forbidden: tuple[str, ...], skip: tuple[str, ...] = (), root: Path = ROOT):
    """`file: module` for each import under root/folder of a module in (or below) one of `forbidden`."""
    return [f"{path.relative_to(root)}: {name}" for path in sorted((root / folder).rglob("*.py"))
            if path.name not in skip for name in sorted(imported(path))
            if any(name == f or name.startswith(f + ".") for f in forbidden)]


def test_the_shared_package_imports_no_service():
    above = tuple(f"treeserve.{name}" for name in SERVICES) + (CLI, BENCH)
    # __main__.py is `python -m treeserve`: the command line's entry point.
    found = forbidden_imports("services/common", above, skip=("__main__.py",))
    assert not found, found


def test_a_service_imports_no_other_service_and_no_bench():
    for name, folder in SERVICES.items():
        others = tuple(f"treeserve.{other}" for other in SERVICES if other != name)
        found = forbidden_imports(folder, others + (BENCH,))
        assert not found, found


def test_the_kernels_import_no_service():
    found = forbidden_imports("kernels", tuple(f"treeserve.{name}" for name in SERVICES) + (CLI, BENCH))
    assert not found, found


def test_serving_code_imports_no_drafter_training():
    found = [line for folder in ("services/common", *SERVICES.values())
             for line in forbidden_imports(folder, (TRAINING,)) if not line.startswith("services/drafter/training/")]
    assert not found, found


def test_a_test_module_imports_no_other_test_module():
    """Shared test code lives in helper modules (helpers, tiny_models, random_targets), which pytest does not
    collect: a test module can change without breaking another, and none is loaded twice (by pytest and by an
    import) under pytest's importlib mode."""
    tests = {path.stem for path in (ROOT / "tests").glob("test_*.py")}
    found = [f"{path.name}: {name}" for path in sorted((ROOT / "tests").glob("*.py")) for name in imported(path)
             if name.split(".")[0] in tests or name.startswith("tests.")]
    assert not found, found


def test_the_rules_see_an_import(tmp_path):
    """The checker itself: each spelling of an import of the benches is caught, and only those."""
    folder = tmp_path / "services" / "gateway"
    folder.mkdir(parents=True)
    (folder / "a.py").write_text("import treeserve.bench.load\n")
    (folder / "b.py").write_text("from treeserve import bench\n")
    (folder / "c.py").write_text("def f():\n    from treeserve.bench.load import main_bench\n")
    (folder / "d.py").write_text("from treeserve import benchmarks, gateway\nimport treeserve.benchmark\n")
    found = forbidden_imports("services/gateway", (BENCH,), root=tmp_path)
    assert sorted({line.split(":")[0] for line in found}) == [f"services/gateway/{name}.py" for name in "abc"]
