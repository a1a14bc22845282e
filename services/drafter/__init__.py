from pathlib import Path

from treeserve.drafter.ngram import NgramDrafter

__all__ = ["NgramDrafter", "load_drafter", "resolve_kind", "shipped_dflash"]

# DFlash drafters trained by this project and shipped in the package: target name -> checkpoint folder.
SHIPPED_DFLASH = {"smollm2-135m": Path(__file__).parent / "checkpoints" / "smollm2-135m"}


def shipped_dflash(target_spec: str | None) -> Path | None:
    """The DFlash checkpoint shipped for this target name, or None."""
    return SHIPPED_DFLASH.get(target_spec or "")


def resolve_kind(kind: str, target_spec: str | None) -> str:
    """`auto` is prompt lookup merged with the target's shipped DFlash drafter where one ships, else n-gram; other
    kinds stay."""
    if kind != "auto":
        return kind
    return "merged" if shipped_dflash(target_spec) else "ngram"


def load_drafter(kind: str, path: str | None = None, tree: str = "ddtree", *, target=None,
                 target_spec: str | None = None, device: str = "cpu", dtype: str = "float32", max_batch: int = 64,
                 kv_cache_tokens: int = 0, graphs: bool = False, max_budget: int | None = None):
    """A drafter by kind (auto, ngram, dflash, model) for a target: `target` when it is already loaded (a
    LoadedModel), else `target_spec`, of which a DFlash drafter loads the weights it borrows and a draft model
    only the tokenizer it must share. `path` is the DFlash checkpoint (default: the one shipped for the target)
    or the draft model. A DFlash drafter keeps `kv_cache_tokens` of context (0: its default) and, with `graphs`,
    replays its block forward from CUDA graphs up to `max_batch` requests (captured here), and builds trees of
    up to `max_budget` nodes (default: the largest budget any request may ask for)."""
    from treeserve.errors import TreeserveError

    spec = target.name if target is not None else target_spec
    kind = resolve_kind(kind, spec)
    if kind == "ngram":
        return NgramDrafter()
    if kind not in ("dflash", "merged", "model"):
        raise TreeserveError(f"unknown drafter kind {kind!r} (use auto, ngram, dflash, merged or model)")
    if kind in ("dflash", "merged") and not path:
        path = shipped_dflash(spec)
        if path is None:
            raise TreeserveError(f"no DFlash drafter ships for target {spec!r}: train one with `treeserve "
                                 "train-drafter` and pass its folder as --drafter-path")
    if not path:
        raise TreeserveError("the model drafter needs --drafter-path (a draft model sharing the target's tokenizer)")
    from treeserve.loading import load_target, load_tokenizer

    if kind == "model":
        from treeserve.drafter.draft_model import DraftModelDrafter

        tokenizer = target.tokenizer if target is not None else load_tokenizer(target_spec)
        return DraftModelDrafter.load(path, device, dtype, tokenizer)
    from treeserve.drafter.dflash import DFlashDrafter
    from treeserve.tree import MAX_BUDGET

    target = target if target is not None else load_target(target_spec, device=device, dtype=dtype)
    drafter = DFlashDrafter.for_target(path, target.model, tree, max_batch=max_batch,
                                       kv_cache_tokens=kv_cache_tokens, graphs=graphs,
                                       max_budget=max_budget or MAX_BUDGET)
    if graphs:
        drafter.capture()
    if kind == "merged":
        from treeserve.drafter.merged import MergedDrafter

        return MergedDrafter(drafter)
    return drafter
