from treeserve.verifier.engine import Generation, GenerationResult, generate

__all__ = ["Generation", "GenerationResult", "generate"]
