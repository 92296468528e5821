"""Stack configuration: TOML files, bases, overrides and validation errors that name the field."""

from __future__ import annotations

import pytest

from dynaspec.errors import ConfigError, UnknownComponentError
from dynaspec.runtime.config import DecodeConfig, DraftConfig, stack_from_mapping
from dynaspec.runtime.stacks import resolve_stack


@pytest.mark.parametrize("field,value,message", [
    ("depth", 0, r"draft.depth = 0 is invalid: must be an integer >= 1"),
    ("topk", -2, r"draft.topk = -2 is invalid"),
    ("total_tokens", 1.5, r"draft.total_tokens = 1.5 is invalid"),
    ("mode", "forest", r"draft.mode = 'forest' is invalid: must be 'chain', 'tree' or 'auto'"),
])
def test_draft_validation(field, value, message):
    with pytest.raises(ConfigError, match=message):
        DraftConfig(**{field: value})


@pytest.mark.parametrize("field,value,message", [
    ("temperature", -0.1, r"decode.temperature = -0.1 is invalid: must be >= 0"),
    ("top_p", 0.0, r"decode.top_p = 0.0 is invalid: must satisfy 0 < top_p <= 1"),
    ("top_p", 1.5, r"decode.top_p = 1.5"),
    ("max_new_tokens", 0, r"decode.max_new_tokens = 0 is invalid"),
])
def test_decode_validation(field, value, message):
    with pytest.raises(ConfigError, match=message):
        DecodeConfig(**{field: value})


def test_configs_are_frozen():
    stack = stack_from_mapping({"name": "a", "target": "t"})
    with pytest.raises(AttributeError):
        stack.name = "b"
    assert hash(stack) == hash(stack_from_mapping({"name": "a", "target": "t"}))


def test_chain_mode_is_a_one_child_tree():
    stack = stack_from_mapping({"name": "a", "target": "t", "draft": {"mode": "chain", "depth": 5}})
    assert (stack.draft.topk, stack.draft.total_tokens) == (1, 5)


def test_unknown_fields_are_rejected():
    with pytest.raises(ConfigError, match="unknown field.*drafer"):
        stack_from_mapping({"name": "a", "target": "t", "drafer": "x"})
    with pytest.raises(ConfigError, match="unknown stack field 'nope.x'"):
        stack_from_mapping({"name": "a", "target": "t"}).with_overrides({"nope.x": 1})
    with pytest.raises(ConfigError, match=r"unknown field\(s\) draft.deep; draft fields: adaptive, depth, min_confidence, mode, planner, planner_prior, router_overlap, topk, total_tokens"):
        stack_from_mapping({"name": "a", "target": "t", "draft": {"deep": 3}})


def test_draft_planner_names_are_checked():
    stack = stack_from_mapping({"name": "a", "target": "t", "draft": {"adaptive": True, "planner": "cost-gate"}})
    assert stack.draft.planner == "cost-gate"
    with pytest.raises(ConfigError, match="draft.planner.*must be one of 'rate', 'cost', 'cost-gate', 'auto'"):
        stack_from_mapping({"name": "a", "target": "t", "draft": {"planner": "costs"}})


def test_overrides(registry):
    stack = resolve_stack("eagle", registry=registry,
                          overrides={"draft.depth": 4, "backend": "torch", "scheduler.budget": 99,
                                     "decode.temperature": 0.5})
    assert stack.draft.depth == 4 and stack.scheduler.kwargs == {"budget": 99}
    assert stack.decode.temperature == 0.5 and stack.verifier_name == "sampling"
    assert resolve_stack("eagle", registry=registry).verifier_name == "greedy"


def test_stack_file_with_base(tmp_path, registry):
    base = tmp_path / "base.toml"
    base.write_text('name = "b"\ntarget = "tiny-llama"\ndrafter = "none"\n[draft]\ndepth = 3\n')
    child = tmp_path / "child.toml"
    child.write_text('base = "base.toml"\nname = "c"\n[scheduler]\nname = "fixed"\nbudget = 7\n'
                     '[draft]\ntopk = 2\n')
    stack = resolve_stack(str(child), registry=registry)
    assert (stack.name, stack.target, stack.drafter) == ("c", "tiny-llama", None)
    assert (stack.draft.depth, stack.draft.topk) == (3, 2)
    assert stack.scheduler.kwargs == {"budget": 7}
    built_in_base = tmp_path / "on-eagle.toml"
    built_in_base.write_text('base = "eagle"\nname = "mine"\n[draft]\ndepth = 2\n')
    assert resolve_stack(str(built_in_base), registry=registry).drafter_label == "gemma3-270m"


def test_bad_files(tmp_path, registry):
    bad = tmp_path / "bad.toml"
    bad.write_text("name = [unclosed")
    with pytest.raises(ConfigError, match="not valid TOML"):
        resolve_stack(str(bad), registry=registry)
    with pytest.raises(ConfigError, match="stack file not found"):
        resolve_stack(str(tmp_path / "missing.toml"), registry=registry)
    cyc = tmp_path / "cyc.toml"
    cyc.write_text('base = "cyc.toml"\nname = "x"\ntarget = "t"\n')
    with pytest.raises(ConfigError, match="cycle"):
        resolve_stack(str(cyc), registry=registry)
    with pytest.raises(UnknownComponentError, match="unknown stack 'nope'"):
        resolve_stack("nope", registry=registry)


def test_a_stack_on_a_base_does_not_inherit_its_description(tmp_path):
    from dynaspec.runtime.stacks import resolve_stack

    child = tmp_path / "child.toml"
    child.write_text('name = "child"\nbase = "eagle-chain"\n[draft]\ndepth = 3\n')
    assert resolve_stack(str(child)).description == ""
    child.write_text('name = "child"\nbase = "eagle-chain"\ndescription = "mine"\n')
    assert resolve_stack(str(child)).description == "mine"
    assert resolve_stack("eagle-chain").description.startswith("full-vocabulary draft head")
