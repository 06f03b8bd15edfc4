"""Long-context evaluation: passkey retrieval over a length x depth grid and loss by
position (``usp-eval``; the trainer's periodic passkey score). ``passkey`` and ``position``
are pure (case generation, scoring, bucketing); ``runner`` runs the cases through the
sharded model; ``report`` writes the JSON files, heatmap and curves."""
