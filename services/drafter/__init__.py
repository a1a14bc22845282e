from treeserve.drafter.ngram import NgramDrafter

__all__ = ["NgramDrafter", "load_drafter"]


def load_drafter(kind: str, path: str | None = None, tree: str = "ddtree", *, target=None,
                 target_spec: str | None = None, device: str = "cpu", dtype: str = "float32"):
    """A drafter by kind (ngram, dflash, model) for a target: `target` when it is already loaded (a
    LoadedModel), else `target_spec`, of which a DFlash drafter loads the weights it borrows and a draft model
    only the tokenizer it must share. `path` is the DFlash checkpoint or the draft model."""
    from treeserve.errors import TreeserveError

    if kind == "ngram":
        return NgramDrafter()
    if kind not in ("dflash", "model"):
        raise TreeserveError(f"unknown drafter kind {kind!r} (use ngram, dflash or model)")
    if not path:
        raise TreeserveError(f"the {kind} drafter needs --drafter-path (a DFlash checkpoint folder, or a draft "
                             "model)")
    from treeserve.loading import load_target, load_tokenizer

    if kind == "model":
        from treeserve.drafter.draft_model import DraftModelDrafter

        tokenizer = target.tokenizer if target is not None else load_tokenizer(target_spec)
        return DraftModelDrafter.load(path, device, dtype, tokenizer)
    from treeserve.drafter.dflash import DFlashDrafter

    target = target if target is not None else load_target(target_spec, device=device, dtype=dtype)
    return DFlashDrafter.for_target(path, target.model, tree)
