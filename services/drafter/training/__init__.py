"""Training DFlash drafters, apart from the drafter service, which never imports it: the prompts cut from code
and documentation (`corpus`), where they come from and how each set is built (`corpus_sources`, `treeserve
make-prompts`), and the training on the target's own answers (`train`, `treeserve train-drafter`)."""
