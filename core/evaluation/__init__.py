"""Tooling that measures stacks: ``eval`` on the dev protocol (:mod:`~dynaspec.evaluation.evaluate`),
``bench`` on Spec-Bench-format questions (:mod:`~dynaspec.evaluation.bench`), ``bench-head``
(:mod:`~dynaspec.evaluation.bench_head`), ``eval-shortlist`` (:mod:`~dynaspec.evaluation.shortlist`),
the cost model (:mod:`~dynaspec.evaluation.cost_model`) and the plots (:mod:`~dynaspec.evaluation.plots`)."""
