"""Measurement tools: `treeserve bench` (load a running gateway), the serving tables in one command, the
transport, verification and kernel benches, outside baselines and the checks run on their output. They sit
above the services, which never import them (tests/test_layout.py)."""


def print_report(report: dict, out) -> None:
    """Print a bench's JSON report, and write it to `out` (a Path, its folder made) when given."""
    import json

    text = json.dumps(report, indent=1)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    print(text)
