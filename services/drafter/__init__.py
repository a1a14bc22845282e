from treeserve.drafter.ngram import NgramDrafter

__all__ = ["NgramDrafter"]
