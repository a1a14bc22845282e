"""treeserve: lossless speculative decoding with draft trees.

In-process API (names load lazily, so `import treeserve` stays cheap for the command line):

    import treeserve
    target = treeserve.load_target("smollm2-135m")                # name, HF folder or .gguf
    prompt = target.tokenizer.encode("def fibonacci(n):")
    result = treeserve.generate(target.model, target.tokenizer, prompt,
                                treeserve.GenerationParams(max_new_tokens=64),
                                drafter=treeserve.NgramDrafter(), budget=16)
    print(result.text, result.mean_accepted)
"""

import importlib

_EXPORTS = {
    "load_target": "treeserve.loading",
    "GenerationParams": "treeserve.params",
    "generate": "treeserve.verifier.engine",
    "Generation": "treeserve.verifier.engine",
    "GenerationResult": "treeserve.verifier.engine",
    "NgramDrafter": "treeserve.drafter.ngram",
    "DraftTree": "treeserve.tree",
    "TreeserveError": "treeserve.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'treeserve' has no attribute {name!r}")
