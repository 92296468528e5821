"""Prompt formats: how a target wants one user message written.

A target owns its format (:attr:`dynaspec.runtime.target.TargetModel.prompt_format`). The embedded Gemma 3
270M is the *base* model, without a chat template, so its format is the plain
``"User: {text}\\nAssistant:"`` (see :mod:`dynaspec.training.data` for why), which is also what the shipped
drafter was trained on. The tokenizer adds ``<bos>`` itself, so formats carry none.
"""

from __future__ import annotations

#: the format of the embedded Gemma target (and the default for targets that set none)
BASE_MODEL_FORMAT = "User: {text}\nAssistant:"


def format_prompt(user_text: str, template: str = BASE_MODEL_FORMAT) -> str:
    """``template`` with the user's text in place of ``{text}``."""
    return template.replace("{text}", user_text)
