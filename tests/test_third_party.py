"""A real third-party plugin package: built, pip-installed into an isolated directory, discovered
through its entry point and selected by a stack file; a broken one does not break the others."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from conftest import trained_drafter

PLUGIN_MODULE = '''
"""Every other token of the vocabulary, plus the special ones."""
import torch
from dynaspec import Component, hookimpl
from dynaspec.runtime.types import Shortlist


class EveryOther:
    def __init__(self, params, ctx):
        ids = torch.arange(int(params.get("offset", 0)), ctx.vocab_size, 2)
        special = torch.tensor(ctx.special_token_ids, dtype=torch.long)
        self.shortlist = Shortlist(torch.unique(torch.cat([ids, special])))

    def propose(self, step, scheduler):
        return self.shortlist


@hookimpl
def dynaspec_shortlisters():
    return [Component("every-other", EveryOther, "every other token id")]


def _quiz_target(params, ctx):
    """The tiny random Llama, with a prompt format of its own."""
    from dynaspec.plugins.tiny import tiny_target

    target = tiny_target("llama")
    target.prompt_format = "Q: {text}\\nA:"
    target.name = "quiz"
    return target


@hookimpl
def dynaspec_targets():
    return [Component("quiz", _quiz_target, "tiny Llama answering in a Q/A format")]
'''


def _package(root: Path, name: str, module: str, source: str) -> Path:
    pkg = root / name
    (pkg / module).mkdir(parents=True)
    (pkg / module / "__init__.py").write_text(source)
    (pkg / "pyproject.toml").write_text(textwrap.dedent(f'''
        [build-system]
        requires = ["setuptools>=61"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "{name}"
        version = "0.3.1"
        [project.entry-points.dynaspec]
        {module} = "{module}"
        [tool.setuptools]
        packages = ["{module}"]
    '''))
    return pkg


def pip_install(package: Path, site: Path) -> None:
    """Install a package folder into ``site`` (added to PYTHONPATH by :func:`_cli`)."""
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(package)], check=True, timeout=600)


def _cli(site: Path, *argv: str, strict: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("DYNASPEC_STRICT_PLUGINS", None)
    if strict:
        env["DYNASPEC_STRICT_PLUGINS"] = "1"
    return subprocess.run([sys.executable, "-m", "dynaspec", *argv], capture_output=True, text=True,
                          env=env, timeout=600)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    root = tmp_path_factory.mktemp("plugins")
    site = root / "site"
    good = _package(root, "dynaspec-every-other", "dynaspec_every_other", PLUGIN_MODULE)
    bad = _package(root, "dynaspec-broken", "dynaspec_broken", "raise ImportError('broken on purpose')\n")
    for pkg in (good, bad):
        pip_install(pkg, site)
    return site


def plugin_rows(site: Path) -> dict[str, dict]:
    """``dynaspec plugins --json`` with ``site`` on the path, by plugin name."""
    out = _cli(site, "plugins", "--json")
    assert out.returncode == 0, out.stderr
    return {row["plugin"]: row for row in json.loads(out.stdout)}


def test_installed_plugin_is_discovered_and_broken_one_reported(site):
    rows = plugin_rows(site)
    assert rows["dynaspec_every_other"]["distribution"] == "dynaspec-every-other"
    assert rows["dynaspec_every_other"]["version"] == "0.3.1"
    assert rows["dynaspec_every_other"]["components"] == "shortlister:every-other, target:quiz"
    assert rows["dynaspec_broken"]["status"].startswith("FAILED") and "broken on purpose" in rows[
        "dynaspec_broken"]["status"]
    assert rows["verifiers"]["status"] == "built-in"  # the others keep working
    strict = _cli(site, "plugins", strict=True)
    assert strict.returncode == 2 and "dynaspec_broken" in strict.stderr and "broken on purpose" in strict.stderr


def test_stack_file_selects_the_plugin(site, tmp_path):
    trained_drafter("llama").save(tmp_path / "drafter")
    stack = tmp_path / "every-other.toml"
    stack.write_text(f'name = "every-other"\ntarget = "tiny-llama"\ndrafter = "{tmp_path / "drafter"}"\n'
                     '[shortlister]\nname = "every-other"\noffset = 1\n'
                     '[draft]\nmode = "chain"\ndepth = 3\n')
    out = _cli(site, "generate", "Hello", "--stack", str(stack), "--max-new-tokens", "12", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    # the odd ids: 64 of 128, the special token (EOS = 1) among them
    assert data["mean_shortlist_size"] == 64 and data["new_tokens"] == 12
    baseline = tmp_path / "plain.toml"
    baseline.write_text('name = "plain"\ntarget = "tiny-llama"\ndrafter = "none"\n')
    plain = json.loads(_cli(site, "generate", "Hello", "--stack", str(baseline),
                            "--max-new-tokens", "12", "--json").stdout)
    assert data["token_ids"] == plain["token_ids"]  # exactness with the plugin's shortlist


def test_wheel_has_one_top_level_package(tmp_path):
    repo = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path), str(repo)], check=True, timeout=600)
    wheel = next(tmp_path.glob("dynaspec-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"dynaspec"}
    assert "dynaspec/plugins/verifiers.py" in names and "dynaspec/stack_files/eagle.toml" in names


def test_third_party_target_plugin(site, tmp_path):
    """A target added by a plugin package is chosen by name in a stack and brings its own prompt
    format: its greedy output is the tiny Llama's on the prompt written in that format."""
    stack = tmp_path / "quiz.toml"
    stack.write_text('name = "quiz"\ntarget = "quiz"\ndrafter = "none"\n')
    out = _cli(site, "generate", "Hello", "--stack", str(stack), "--max-new-tokens", "8", "--json")
    assert out.returncode == 0, out.stderr
    plain = tmp_path / "plain.toml"
    plain.write_text('name = "plain"\ntarget = "tiny-llama"\ndrafter = "none"\n')
    raw = _cli(site, "generate", "Q: Hello\nA:", "--raw", "--stack", str(plain), "--max-new-tokens", "8", "--json")
    assert raw.returncode == 0, raw.stderr
    assert json.loads(out.stdout)["token_ids"] == json.loads(raw.stdout)["token_ids"]
    unknown = _cli(site, "generate", "Hello", "--set", "target=nope")
    assert unknown.returncode == 2 and "unknown target 'nope'" in unknown.stderr and "quiz" in unknown.stderr
