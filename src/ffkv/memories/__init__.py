"""Engines over a model's memories that more than one step (or the browser) uses, beneath the
steps: the values' vocabulary tops (`value_tops`), the token index (`value_index`) and the
re-scoring of coefficients on many sequences that share prefixes (`rescore`).

They sit above `model` and `store` (they read and write a run's tables; `rescore` packs its
batches with `ffkv.corpus.batching`) and import nothing from `ffkv.steps`."""
