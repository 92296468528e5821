"""Plugin manager and component registry.

Plugins are found through the ``dynaspec`` entry-point group, loaded one at a time and guarded: a
plugin that fails to import is reported with its name and version and the others keep working
(``DYNASPEC_STRICT_PLUGINS=1`` turns that into an error). The built-in components are declared in
the same group by the ``dynaspec`` distribution itself and count as *defaults*: a third-party
component may replace one by registering the same name with ``override=True``.
"""

from __future__ import annotations

import importlib.metadata
import os
from typing import Any, Callable, Iterable

import attrs
import pluggy

from dynaspec.errors import DuplicateComponentError, PluginLoadError, UnknownComponentError
from dynaspec.runtime import hookspecs

#: Component families and the hook that provides each.
KINDS: dict[str, str] = {
    "shortlister": "dynaspec_shortlisters",
    "scheduler": "dynaspec_schedulers",
    "backend": "dynaspec_backends",
    "verifier": "dynaspec_verifiers",
    "drafter": "dynaspec_drafters",
    "target": "dynaspec_targets",
}
BUILTIN_DISTRIBUTION = "dynaspec"
STRICT_ENV = "DYNASPEC_STRICT_PLUGINS"


@attrs.frozen
class Component:
    """A named component a plugin contributes: ``factory(params, ctx)`` builds it."""

    name: str = attrs.field(validator=attrs.validators.matches_re(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$"))
    factory: Callable[..., Any] = attrs.field(eq=False)
    description: str = ""
    #: Replace a built-in component of the same name instead of clashing with it.
    override: bool = False
    #: Its parameters as a frozen attrs class (see :mod:`dynaspec.runtime.params`): the factory
    #: then gets an instance of it, checked; without one it gets the stack's table as a dict.
    params: type | None = None
    #: Targets only: a string naming the exact weights the target loads (its source file's hash,
    #: the converter's version) and every choice of the plugin its set-up depends on (what its
    #: ``auto_weights`` and ``w8a8_int16`` are), or a callable returning it. With one, the first load saves a
    #: ready-to-map image of the set-up target and later starts map it
    #: (:mod:`dynaspec.runtime.image`); without, the target loads in full every time.
    image_id: Any = attrs.field(default=None, eq=False)


@attrs.frozen
class PluginInfo:
    """One loaded (or failed) plugin and what it provides."""

    name: str
    distribution: str
    version: str
    builtin: bool
    error: str | None = None
    components: tuple[tuple[str, str], ...] = ()  # (kind, name)

    @property
    def label(self) -> str:
        return f"{self.name} ({self.distribution} {self.version})"


@attrs.frozen
class _Entry:
    component: Any
    provider: PluginInfo


def _strict() -> bool:
    return os.environ.get(STRICT_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


class Registry:
    """Named components of every kind, plus named stacks, with their providers."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: list[PluginInfo] = []
        self._entries: dict[str, dict[str, _Entry]] = {kind: {} for kind in [*KINDS, "stack"]}

    # -- building -----------------------------------------------------------------------------
    @classmethod
    def create(cls, *, entry_points: bool = True, plugins: Iterable[Any] = ()) -> "Registry":
        """A registry filled from installed entry points (unless ``entry_points=False``) and from
        the given plugin objects or modules (registered as third-party, in order)."""
        registry = cls()
        if entry_points:
            registry.load_entry_points()
        for plugin in plugins:
            registry.add_plugin(plugin)
        return registry

    def load_entry_points(self) -> None:
        eps = sorted(
            importlib.metadata.entry_points(group=hookspecs.PROJECT_NAME),
            # built-ins first, so third-party overrides apply on top of them
            key=lambda ep: (_dist_name(ep) != BUILTIN_DISTRIBUTION, _dist_name(ep), ep.name),
        )
        for ep in eps:
            dist, version = _dist_name(ep), _dist_version(ep)
            try:
                plugin = ep.load()
            except Exception as exc:  # noqa: BLE001 - a broken plugin must not break the others
                info = PluginInfo(ep.name, dist, version, dist == BUILTIN_DISTRIBUTION,
                                  error=f"{type(exc).__name__}: {exc}")
                self.plugins.append(info)
                if _strict():
                    raise PluginLoadError(
                        f"plugin {info.label} failed to load: {info.error}"
                    ) from exc
                continue
            self.add_plugin(plugin, name=ep.name, distribution=dist, version=version)

    def add_plugin(self, plugin: Any, *, name: str | None = None, distribution: str | None = None,
                   version: str = "") -> PluginInfo:
        """Register one plugin object or module and collect the components it provides."""
        name = name or getattr(plugin, "__name__", None) or type(plugin).__name__
        distribution = distribution or "(in-process)"
        builtin = distribution == BUILTIN_DISTRIBUTION
        info = PluginInfo(name, distribution, version, builtin)
        try:
            registered = self.pm.register(plugin, name=f"{distribution}:{name}")
            provided = self._collect(registered, info)
        except DuplicateComponentError:
            raise
        except Exception as exc:  # noqa: BLE001
            self.pm.unregister(name=f"{distribution}:{name}")
            info = attrs.evolve(info, error=f"{type(exc).__name__}: {exc}")
            self.plugins.append(info)
            if _strict():
                raise PluginLoadError(f"plugin {info.label} failed: {info.error}") from exc
            return info
        info = attrs.evolve(info, components=tuple(provided))
        self.plugins.append(info)
        return info

    def _collect(self, plugin_name: str | None, info: PluginInfo) -> list[tuple[str, str]]:
        provided: list[tuple[str, str]] = []
        staged: list[tuple[str, str, Any, bool]] = []
        for kind, hook_name in [*KINDS.items(), ("stack", "dynaspec_stacks")]:
            # call this plugin's own implementation, so every component is attributed to it
            impls = [i for i in getattr(self.pm.hook, hook_name).get_hookimpls()
                     if i.plugin_name == plugin_name]
            if not impls:
                continue
            result = impls[0].function()
            if result is None:
                continue
            if kind == "stack":
                for stack_name, spec in dict(result).items():
                    staged.append((kind, stack_name, spec, False))
                continue
            for component in result:
                if not isinstance(component, Component):
                    raise TypeError(f"{hook_name} must return Component objects, got {component!r}")
                staged.append((kind, component.name, component, component.override))
        # validate the whole plugin before registering any of it
        for kind, cname, _, override in staged:
            self._check_clash(kind, cname, info, override)
        for kind, cname, obj, _ in staged:
            self._entries[kind][cname] = _Entry(obj, info)
            provided.append((kind, cname))
        return provided

    def _check_clash(self, kind: str, name: str, info: PluginInfo, override: bool) -> None:
        existing = self._entries[kind].get(name)
        if existing is None:
            return
        if override and existing.provider.builtin and not info.builtin:
            return
        raise DuplicateComponentError(
            f"{kind} '{name}' is provided twice: by {existing.provider.label} and by {info.label}"
            + ("" if info.builtin or not existing.provider.builtin
               else " (register it with override=True to replace the built-in)")
        )

    # -- lookup -------------------------------------------------------------------------------
    def names(self, kind: str) -> list[str]:
        return sorted(self._entries[kind])

    def get(self, kind: str, name: str) -> Any:
        """The component (or stack mapping) named ``name``; unknown names list the alternatives."""
        if kind not in self._entries:
            raise UnknownComponentError(f"unknown component kind '{kind}'")
        entry = self._entries[kind].get(name)
        if entry is None:
            available = ", ".join(self.names(kind)) or "(none)"
            failed = [p for p in self.plugins if p.error]
            why = "".join(f"; plugin {p.label} failed to load ({p.error}), so whatever it provides "
                          "is missing" for p in failed)
            raise UnknownComponentError(f"unknown {kind} '{name}'{why}; available: {available}")
        return entry.component

    def check_stack(self, stack: Any) -> None:
        """Raise for any component a :class:`~dynaspec.runtime.config.StackConfig` names that no plugin
        provides, or whose declared parameters are invalid: cheap, so commands call it before
        loading a model."""
        from pathlib import Path

        from dynaspec.runtime.params import parse

        for kind in ("shortlister", "scheduler", "backend", "verifier"):
            ref = getattr(stack, kind)
            params = getattr(self.get(kind, ref.name), "params", None)
            if params is not None:  # typed parameters are checked here too, before any model loads
                parse(kind, ref.name, params, ref.kwargs)
        if stack.drafter is not None:
            from dynaspec.runtime.drafters import drafter_component

            ref = drafter_component(stack.drafter, self)
            params = getattr(self.get("drafter", ref.name), "params", None)
            if params is not None:
                parse("drafter", ref.name, params, ref.kwargs)
        if stack.target not in self._entries["target"] and not Path(stack.target).is_dir():
            self.get("target", stack.target)  # raises, naming the registered targets

    def provider(self, kind: str, name: str) -> PluginInfo:
        self.get(kind, name)
        return self._entries[kind][name].provider

    def build(self, kind: str, name: str, params: dict, ctx: Any) -> Any:
        """Build the component ``name`` of ``kind`` with its parameters (typed and checked when the
        component declares a parameter class)."""
        component = self.get(kind, name)
        if kind != "stack" and getattr(component, "params", None) is not None:
            from dynaspec.runtime.params import parse

            return component.factory(parse(kind, name, component.params, dict(params)), ctx)
        return component.factory(dict(params), ctx)


def _dist_name(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return dist.metadata["Name"] if dist is not None else "(unknown)"


def _dist_version(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return dist.version if dist is not None else ""


_DEFAULT: Registry | None = None


def default_registry() -> Registry:
    """The process-wide registry of installed plugins (built on first use)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Registry.create()
    return _DEFAULT
