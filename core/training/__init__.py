"""Tooling that builds the artifacts a stack uses, on the train split only: the data split and
slices (:mod:`~dynaspec.training.data`), the shard format (:mod:`~dynaspec.training.shards`), the
feature collection (:mod:`~dynaspec.training.collect`), the drafter's training
(:mod:`~dynaspec.training.drafter`, and :mod:`~dynaspec.training.quick` for small in-memory runs),
the frequency lists and clusters (:mod:`~dynaspec.training.vocabulary`) and the router
(:mod:`~dynaspec.training.router`)."""
