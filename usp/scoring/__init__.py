"""Passkey retrieval and loss by position, the part both ``usp-eval`` (``usp.eval``) and the
trainer's periodic passkey score (``usp.train``) use: ``passkey`` (cases and their scoring)
and ``position`` (loss buckets) are pure; ``grid`` builds a config's passkey grid (its
tokenizer, haystack and cases); ``report`` writes the JSON files, heatmap and curves."""
