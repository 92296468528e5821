"""Exceptions of dynaspec. Every one of them is a user-facing error the CLI prints on one line."""

from __future__ import annotations


class DynaspecError(Exception):
    """Base class: an error the user can act on (the CLI prints it without a traceback)."""


class ConfigError(DynaspecError, ValueError):
    """A stack or component parameter is invalid; the message names the field and the bad value."""


class UnknownComponentError(DynaspecError, LookupError):
    """A stack names a component, stack or target that no installed plugin provides."""


class DuplicateComponentError(DynaspecError):
    """Two plugins provide a component under the same name."""


class PluginLoadError(DynaspecError):
    """A plugin entry point failed to load (raised only in strict mode)."""


class ArtifactMismatchError(DynaspecError):
    """An artifact (drafter, clusters, router, frequency list) was built for another target."""


class InputError(DynaspecError, ValueError):
    """Bad generation input: empty prompt, prompt longer than the context, and the like."""
