"""Evaluation, one home for ``usp-eval`` and the trainer's periodic evaluation alike.

Pure: ``passkey`` (cases and their scoring), ``grid`` (a config's passkey grid: tokenizer,
haystack, cases), ``position`` (loss buckets), ``results`` (the JSON files, heatmap, curves
and console lines). Through the sharded model: ``sharded`` (each token's loss and argmax of
global rows, the passkey scores, the trainer's ``PasskeyScore``) and ``val_loss`` (the
validation loss and held-out accuracy). ``usp-eval``'s command: ``job`` (what it scores,
decided before any process group), ``runner`` (the ranks' half) and ``command`` (how it
starts its ranks); only these two read the run's layout (``usp.run``), which itself reads
the grid to check it."""
