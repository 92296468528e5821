"""Plugin discovery, guarded loading, duplicate / unknown names, overrides, strict mode."""

from __future__ import annotations

import importlib.metadata
import types

import pytest

from conftest import builtin_registry
from dynaspec import Component, hookimpl
from dynaspec.errors import DuplicateComponentError, PluginLoadError, UnknownComponentError
from dynaspec.runtime.registry import Registry


class Provides:
    def __init__(self, kind_hook: str, *names: str, override: bool = False):
        self.components = [Component(n, lambda p, c: object(), override=override) for n in names]
        setattr(self, kind_hook, hookimpl(lambda: self.components))


def test_builtins_are_registered(registry):
    assert registry.names("shortlister") == ["dynaspec", "frequency", "full", "hybrid"]
    assert registry.names("verifier") == ["auto", "greedy", "sampling"]
    assert registry.names("scheduler") == ["confidence", "fixed", "position-aware"]
    assert "eagle" in registry.names("stack") and "baseline" in registry.names("stack")
    assert registry.provider("backend", "torch").distribution == "dynaspec"


def test_installed_entry_points_include_builtins():
    eps = importlib.metadata.entry_points(group="dynaspec")
    assert {ep.value for ep in eps} >= {"dynaspec.plugins.verifiers", "dynaspec.shortlisters.full"}
    registry = Registry.create()
    assert not [p for p in registry.plugins if p.error], registry.plugins
    assert "full" in registry.names("shortlister")


def test_unknown_name_lists_available(registry):
    with pytest.raises(UnknownComponentError, match=r"unknown shortlister 'nope'; available: dynaspec, frequency, full, hybrid"):
        registry.get("shortlister", "nope")


def test_duplicate_names_raise_and_name_both_providers():
    registry = builtin_registry()
    registry.add_plugin(Provides("dynaspec_shortlisters", "mine"), name="first", distribution="pkg-a",
                        version="1.0")
    with pytest.raises(DuplicateComponentError, match=r"pkg-a 1\.0.*pkg-b 2\.0"):
        registry.add_plugin(Provides("dynaspec_shortlisters", "mine"), name="second",
                            distribution="pkg-b", version="2.0")


def test_builtin_clash_needs_override():
    registry = builtin_registry()
    with pytest.raises(DuplicateComponentError, match="override=True"):
        registry.add_plugin(Provides("dynaspec_backends", "torch"), distribution="pkg-c")
    plugin = Provides("dynaspec_backends", "torch", override=True)
    registry.add_plugin(plugin, distribution="pkg-d")
    assert registry.get("backend", "torch") is plugin.components[0]
    assert registry.provider("backend", "torch").distribution == "pkg-d"


def test_a_plugin_whose_hook_fails_is_reported_and_others_work(monkeypatch):
    monkeypatch.delenv("DYNASPEC_STRICT_PLUGINS", raising=False)

    class Broken:
        @hookimpl
        def dynaspec_shortlisters(self):
            raise RuntimeError("boom")

    registry = builtin_registry(Broken())
    failed = [p for p in registry.plugins if p.error]
    assert len(failed) == 1 and "boom" in failed[0].error
    assert registry.names("shortlister") == ["dynaspec", "frequency", "full", "hybrid"]
    monkeypatch.setenv("DYNASPEC_STRICT_PLUGINS", "1")
    with pytest.raises(PluginLoadError, match="boom"):
        builtin_registry(Broken())


def test_broken_entry_point_is_guarded(monkeypatch):
    good = importlib.metadata.EntryPoint("good", "dynaspec.shortlisters.full", "dynaspec")
    bad = importlib.metadata.EntryPoint("bad", "no_such_module_xyz", "dynaspec")
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [bad, good])
    monkeypatch.delenv("DYNASPEC_STRICT_PLUGINS", raising=False)
    registry = Registry.create()
    assert "full" in registry.names("shortlister")
    failed = [p for p in registry.plugins if p.error]
    assert [p.name for p in failed] == ["bad"] and "no_such_module_xyz" in failed[0].error
    # asking for a component the failed plugin may have provided names the plugin and why
    with pytest.raises(UnknownComponentError, match=r"unknown shortlister 'mine'; plugin bad .*failed to "
                       r"load \(ModuleNotFoundError: No module named 'no_such_module_xyz'\)"):
        registry.get("shortlister", "mine")
    monkeypatch.setenv("DYNASPEC_STRICT_PLUGINS", "1")
    with pytest.raises(PluginLoadError, match="bad"):
        Registry.create()


def test_hooks_need_the_marker():
    """A function named like a hook but not marked is not an implementation."""
    module = types.ModuleType("unmarked")
    module.dynaspec_shortlisters = lambda: [Component("sneaky", lambda p, c: None)]
    registry = builtin_registry(module)
    assert "sneaky" not in registry.names("shortlister")


def test_components_must_be_components():
    class Wrong:
        @hookimpl
        def dynaspec_schedulers(self):
            return ["not-a-component"]

    registry = builtin_registry(Wrong())
    assert any(p.error and "Component" in p.error for p in registry.plugins)


def test_a_plugin_can_provide_a_target(tmp_path):
    """Targets are components too: a plugin registers one by name and a stack selects it."""
    from dynaspec.plugins.tiny import tiny_target
    from dynaspec.runtime.engine import Engine
    from dynaspec.runtime.targets import load_target

    mine = tiny_target("llama", seed=3)  # its own copy: loading through a stack patches and casts it

    class MyTargets:
        @hookimpl
        def dynaspec_targets(self):
            return [Component("my-tiny", lambda params, ctx: mine, "a tiny llama")]

    registry = builtin_registry(MyTargets())
    assert "my-tiny" in registry.names("target") and "gemma3-270m" in registry.names("target")
    assert load_target("my-tiny", registry=registry) is mine
    engine = Engine.from_stack("tiny-baseline", overrides={"target": "my-tiny", "dtype": "float32"},
                               registry=registry)
    assert engine.target is mine and len(engine.generate([5, 6, 7], max_new_tokens=4).token_ids) == 4
    with pytest.raises(UnknownComponentError, match="unknown target 'nope'"):
        load_target("nope", registry=registry)
