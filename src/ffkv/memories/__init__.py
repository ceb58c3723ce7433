"""Engines over a model's memories that more than one step (or the browser) uses, beneath the
steps: the values' vocabulary tops (`value_tops`) and the token index (`value_index`).

They sit above `model` and `store` (they read and write a run's tables) and import nothing from
`ffkv.steps`."""
