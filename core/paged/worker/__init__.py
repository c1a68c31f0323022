"""Execution on one device: the model runner (a scheduled batch -> tensors -> forward ->
sampled tokens), input packing, and the eager and graph-capturing forward strategies.

Depends on `paged.scheduled` (what a step asks), the model and the platform; never on the
engine above it."""
