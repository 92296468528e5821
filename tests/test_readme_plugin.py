"""The README's plugin example, taken from the README itself, is built, pip-installed, discovered
and used by a stack: its output equals plain decoding, and its typed parameter is checked."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_third_party import _cli, pip_install, plugin_rows

from conftest import trained_drafter

README = Path(__file__).resolve().parents[1] / "README.md"


def _block(language: str, first_line: str) -> str:
    blocks = re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)
    found = [b for b in blocks if b.startswith(first_line + "\n")]
    assert len(found) == 1, f"README has no single {language} block starting with {first_line!r}"
    return found[0]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    root = tmp_path_factory.mktemp("readme-plugin")
    pkg = root / "my-shortlister"
    (pkg / "my_shortlister").mkdir(parents=True)
    (pkg / "my_shortlister" / "__init__.py").write_text(_block("python", "# my_shortlister/__init__.py"))
    (pkg / "pyproject.toml").write_text(_block("toml", "# pyproject.toml"))
    pip_install(pkg, root / "site")
    return root / "site"


def test_readme_plugin_is_discovered(site):
    rows = plugin_rows(site)
    assert rows["my_shortlister"]["distribution"] == "my-shortlister"
    assert rows["my_shortlister"]["components"] == "shortlister:head-norm"


def test_readme_plugin_generates_exactly_and_checks_its_parameter(site, tmp_path):
    trained_drafter("llama").save(tmp_path / "drafter")
    common = f'target = "tiny-llama"\ndrafter = "{tmp_path / "drafter"}"\n[draft]\nmode = "chain"\ndepth = 3\n'
    stack = tmp_path / "head-norm.toml"
    stack.write_text('name = "head-norm"\n' + common +
                     '[shortlister]\nname = "head-norm"\nrecent = 8\n[scheduler]\nname = "fixed"\nbudget = 16\n')
    out = _cli(site, "generate", "Hello", "--stack", str(stack), "--max-new-tokens", "16", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["new_tokens"] == 16 and 16 <= data["mean_shortlist_size"] < 128  # a real shortlist
    plain = tmp_path / "plain.toml"
    plain.write_text('name = "plain"\ntarget = "tiny-llama"\ndrafter = "none"\n')
    reference = json.loads(_cli(site, "generate", "Hello", "--stack", str(plain), "--max-new-tokens", "16",
                                "--json").stdout)
    assert data["token_ids"] == reference["token_ids"]
    bad = _cli(site, "generate", "Hello", "--stack", str(stack), "--set", "shortlister.recent=-1")
    assert bad.returncode == 2
    assert ("shortlister.recent = -1 is invalid for shortlister 'head-norm': must be an integer >= 0, in tokens"
            in bad.stderr)


def test_readme_stack_example_resolves_as_written(tmp_path):
    """The README's stack file, as written, is a valid stack (every component and artifact it names
    exists), checked without loading a model."""
    from dynaspec.runtime.registry import default_registry
    from dynaspec.runtime.stacks import resolve_stack

    path = tmp_path / "my-stack.toml"
    path.write_text(_block("toml", 'name = "my-stack"'))
    stack = resolve_stack(str(path))
    default_registry().check_stack(stack)
    assert (stack.name, stack.drafter_label, stack.draft.mode, stack.exact) == ("my-stack", "gemma3-270m", "chain", "required")


def test_readme_drafter_decodes_exactly(tmp_path):
    """The README's drafter, taken from the README, registered as a plugin: it drafts, and greedy
    output equals plain decoding."""
    import importlib.util

    from conftest import builtin_registry, reference_greedy, target
    from dynaspec.runtime.config import stack_from_mapping
    from dynaspec.runtime.engine import Engine

    source = tmp_path / "my_drafter.py"
    source.write_text(_block("python", "# my_drafter/__init__.py"))
    spec = importlib.util.spec_from_file_location("my_drafter", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    registry = builtin_registry(module)
    engine = Engine(stack_from_mapping({"name": "b", "target": "tiny-llama", "drafter": "bigram",
                                        "draft": {"mode": "chain", "depth": 4}}), target("llama"), None,
                    registry=registry)
    prompt = [5, 6, 7, 5, 6, 7, 5]
    result = engine.generate(prompt, max_new_tokens=30)
    assert result.token_ids == reference_greedy("llama", prompt, 30)
    assert sum(result.stats.drafted_at) > 0 and engine.exactness == "guaranteed"
    # sampling runs through the same drafter (its lossless check is test_drafters' chi-square)
    assert engine.generate(prompt, max_new_tokens=10, temperature=1.0, seed=1).stats.new_tokens == 10
