"""Tooling that builds the artifacts a stack uses, on the train split only: the data split and
slices (:mod:`~dynaspec.training.data`), the shard format (:mod:`~dynaspec.training.shards`), the
drafter's feature collection and training (:mod:`~dynaspec.training.drafter`), the frequency lists,
clusters and router (:mod:`~dynaspec.training.vocabulary`, :mod:`~dynaspec.training.router`)."""
