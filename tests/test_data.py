"""ShareGPT loading, split, prompt format and slices (reads the ~125 MB file once per session)."""

from __future__ import annotations

import pytest

from dynaspec.training import data


@pytest.fixture(scope="module")
def conversations():
    return data.load_conversations()


def test_complete_conversations_only(conversations):
    assert len(conversations) == data.EXPECTED_CONVERSATIONS == 17_671
    assert conversations[0]["id"] == "QWJhYvA_0"
    for conv in conversations[:: 97]:
        assert isinstance(conv["id"], str)
        assert all({"from", "value"} <= set(msg) for msg in conv["conversations"])


def test_split_is_deterministic_and_about_five_percent(conversations):
    assert data.split_of("QWJhYvA_0") == data.split_of("QWJhYvA_0")
    assert {data.split_of(f"x{i}") for i in range(200)} == {"train", "dev"}
    dev = data.load_split("dev")
    train = data.load_split("train")
    assert len(dev) + len(train) == len(conversations)
    assert 0.04 < len(dev) / len(conversations) < 0.06
    assert {c["id"] for c in dev}.isdisjoint({c["id"] for c in train})
    # file order kept
    position = {id(c): k for k, c in enumerate(conversations)}
    assert [position[id(c)] for c in dev] == sorted(position[id(c)] for c in dev)
    with pytest.raises(ValueError):
        data.load_split("test")


def test_split_rule():
    import hashlib

    for conv_id in ("a", "QWJhYvA_0", "hRPPgZT_0", "zzz_12"):
        bucket = int(hashlib.sha256(conv_id.encode()).hexdigest()[:8], 16) % 1000
        assert data.split_of(conv_id) == ("dev" if bucket < 50 else "train")


def test_first_human_turn_and_answer():
    conv = {"id": "x", "conversations": [
        {"from": "gpt", "value": "leftover answer"},
        {"from": "human", "value": "question?"},
        {"from": "gpt", "value": "answer."}]}
    assert data.first_human_turn(conv) == "question?"
    assert data.first_answer(conv) == "answer."
    assert data.first_human_turn({"id": "y", "conversations": [{"from": "gpt", "value": "a"}]}) is None


@pytest.mark.parametrize("text, expected", [
    ("What is the capital of France? Please explain the history of the city briefly.", "english"),
    ("Write a sonnet about a man named Nigel who likes crossfit", "english"),
    ("Fix this:\n```python\nprint('hi')\n```", "code"),
    ("why does this fail\nimport numpy as np\ndef f(x):\n    return np.sum(x)", "code"),
    ("#include <stdio.h>\nint main() {\n  printf(\"hi\");\n}", "code"),
    ("请用中文写一首关于春天的诗，并解释它的意思。", "non-english"),
    ("고등교육의 필요성에 관한 영어 에세이를 1000자 이내로 작성하시오.", "non-english"),
    ("Kannst du mir bitte erklären, wie die Photosynthese funktioniert und warum sie wichtig ist?",
     "non-english"),
    ("Datenstrukturen wie Keller, Warteschlangen, Listen und Bäume", "non-english"),
    ("¿Puedes escribir un resumen de la historia de España para los estudiantes?", "non-english"),
    ("Peux-tu m'expliquer comment fonctionne la photosynthèse dans les plantes ?", "non-english"),
    ("Write about the Casa de la Playa hotel in Mexico", "english"),
])
def test_slice_of(text, expected):
    assert data.slice_of(text) == expected


def test_slice_uses_answer_for_code():
    assert data.slice_of("How do I reverse a list?") == "english"
    assert data.slice_of("How do I reverse a list?", "Use:\n```python\nxs[::-1]\n```") == "code"


def test_prompt_format():
    from dynaspec.runtime.prompt import format_prompt

    prompt = format_prompt("Hello there")
    assert prompt == "User: Hello there\nAssistant:"
    assert "<bos>" not in prompt  # the tokenizer adds it


def test_dev_protocol_prompts(conversations):
    prompts = data.dev_protocol_prompts()
    assert len(prompts) == 40
    assert prompts == data.dev_protocol_prompts()
    assert all(data.split_of(p["id"]) == "dev" for p in prompts)
    assert all(0 < len(p["text"]) <= 1500 for p in prompts)
    assert {p["slice"] for p in prompts} <= set(data.SLICES)
    assert prompts[0]["id"] == "hRPPgZT_0"
    short = data.dev_protocol_prompts(n=5, max_chars=20)
    assert [p["id"] for p in short] == [p["id"] for p in prompts[:5]]
    assert all(len(p["text"]) <= 20 for p in short)


def test_training_prompts():
    items = list(data.training_prompts(limit=25))
    assert len(items) == 25
    assert all(data.split_of(p["id"]) == "train" and p["text"] for p in items)
    assert items[0]["id"] == "QWJhYvA_0"


def test_a_conversations_slice_is_judged_once(monkeypatch):
    """Collection reads the prompts from the split's start for every shard: the slices of the
    conversations it passes over are remembered, not judged again, and stay what they were."""
    import itertools

    first = [item["slice"] for item in itertools.islice(data.training_prompts(), 0, 300)]
    calls = []
    real = data.conversation_slice
    monkeypatch.setattr(data, "conversation_slice", lambda conv: calls.append(conv) or real(conv))
    again = [item["slice"] for item in itertools.islice(data.training_prompts(), 0, 300)]
    assert again == first and not calls
    more = list(itertools.islice(data.training_prompts(), 300, 310))
    assert len(calls) >= len(more) == 10  # new conversations are judged (dev ones passed over too)
    assert [item["slice"] for item in more] == [real(c) for c in calls if data.split_of(c["id"]) == "train"
                                                 and (data.first_human_turn(c) or "").strip()][:10]
