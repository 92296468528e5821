"""dynaspec: speculative decoding for large-vocabulary language models, with a drafter head that
works on a context-dependent shortlist of the vocabulary.

The one import a plugin author needs::

    from dynaspec import hookimpl, Component
"""

from dynaspec.runtime.hookspecs import hookimpl
from dynaspec.runtime.registry import Component

__version__ = "0.1.0"

__all__ = ["Component", "Engine", "hookimpl", "__version__"]


def __getattr__(name):  # keep `import dynaspec` (and `dynaspec --help`) free of torch
    if name == "Engine":
        from dynaspec.runtime.engine import Engine

        return Engine
    raise AttributeError(name)
