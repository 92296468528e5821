"""The runtime: what ``dynaspec generate`` and ``Engine.from_stack(...)`` need, and nothing else.

- :mod:`~dynaspec.runtime.engine`: the draft / verify / accept cycle.
- :mod:`~dynaspec.runtime.target` and :mod:`~dynaspec.runtime.drafter`: the two models.
- :mod:`~dynaspec.runtime.tree`: draft trees and their attention masks.
- :mod:`~dynaspec.runtime.types`: the values that cross the plugin boundary.
- :mod:`~dynaspec.runtime.registry`, :mod:`~dynaspec.runtime.hookspecs`: plugin discovery.
- :mod:`~dynaspec.runtime.config`, :mod:`~dynaspec.runtime.stacks`: stack files.

Nothing here imports :mod:`dynaspec.training` or :mod:`dynaspec.evaluation`.
"""
