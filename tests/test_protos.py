"""The committed generated code matches the protos: regenerate into a temporary folder and compare."""

from treeserve import protogen


def test_generated_code_is_fresh(tmp_path):
    fresh = {path.name: path.read_text() for path in protogen.generate(tmp_path)}
    committed = {path.name: path.read_text() for path in protogen.GENERATED.glob("*_pb2*.py*")}
    assert fresh.keys() == committed.keys(), "run: python -m treeserve.protogen"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale generated code {stale}: run python -m treeserve.protogen"
