"""dynaspec: speculative decoding for large-vocabulary language models, with a drafter head that
works on a context-dependent shortlist of the vocabulary.

What a user and a plugin author import::

    from dynaspec import Engine                                  # the engine
    from dynaspec import hookimpl, Component                     # declaring components
    from dynaspec import Shortlist, DraftStep, BuildContext      # the values they exchange
    from dynaspec import DraftTree, DrafterContext               # what a drafter gets and returns
    from dynaspec import param                                   # typed component parameters

The code is laid out as :mod:`dynaspec.runtime` (what generation needs), :mod:`dynaspec.cli`,
:mod:`dynaspec.training` and :mod:`dynaspec.evaluation` (tooling), and the built-in plugins in
:mod:`dynaspec.plugins`, :mod:`dynaspec.shortlisters` and :mod:`dynaspec.schedulers`.
"""

from dynaspec.runtime.hookspecs import hookimpl
from dynaspec.runtime.registry import Component

__version__ = "0.1.0"

__all__ = ["BuildContext", "Component", "DraftStep", "DraftTree", "DrafterContext", "Engine", "Shortlist", "hookimpl",
           "param", "__version__"]

# imported on first use, so that `import dynaspec` (and `dynaspec --help`) stays free of torch
_LAZY = {"Engine": "dynaspec.runtime.engine", "Shortlist": "dynaspec.runtime.types",
         "DraftStep": "dynaspec.runtime.types", "BuildContext": "dynaspec.runtime.types",
         "param": "dynaspec.runtime.params", "DraftTree": "dynaspec.runtime.tree",
         "DrafterContext": "dynaspec.runtime.drafters"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dynaspec' has no attribute {name!r}")
