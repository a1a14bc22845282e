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


def host_work_rows(bench: str, target_name: str, dtype: str, cells: list) -> list[dict] | None:
    """The rows of a host-work bench (tree_round, draft_round): the target loaded on the CPU, torch on one thread
    (host work: a second intra-op thread only adds waits between threads), and for each (label, measure) of
    `cells` the row `measure(target)` returns, its phases printed as it comes. None where the target or a cell
    fails with a TreeserveError, which is printed."""
    import sys

    import torch

    from treeserve.errors import TreeserveError
    from treeserve.loading import load_target

    torch.set_num_threads(1)
    try:
        target = load_target(target_name, "cpu", dtype)
        rows = []
        for label, measure in cells:
            rows.append(measure(target))
            print(f"{bench}: {label}: " + ", ".join(f"{phase} {us:.1f}" for phase, us in rows[-1]["us"].items())
                  + " us", file=sys.stderr, flush=True)
    except TreeserveError as error:
        print(f"{bench}: error: {error}", file=sys.stderr)
        return None
    return rows
