"""Where two outputs of the same request part ways: what `treeserve bench` records of greedy runs whose tokens differ
from plain decoding's, and what `python -m treeserve.bench.near_ties` checks to be near-ties of the target."""

from __future__ import annotations


def first_divergence(one: list[int], other: list[int]) -> int | None:
    """The first position where two outputs differ (the shorter one's length where one extends the other); None
    where they are equal."""
    at = next((i for i, (a, b) in enumerate(zip(one, other)) if a != b), None)
    if at is None and len(one) != len(other):
        at = min(len(one), len(other))
    return at


def divergence(one: list[int], other: list[int]) -> dict | None:
    """Where `other` parts from `one`: the position, the tokens they share before it, and each one's token there
    (None past an output's end); None where they are equal."""
    at = first_divergence(one, other)
    if at is None:
        return None
    return {"at": at, "shared": list(one[:at]), "first": one[at] if at < len(one) else None,
            "other": other[at] if at < len(other) else None}
