"""nox sessions: `nox -s tests-torch`, `tests-torch-blocked`, `tests-int8-blocked`, `tests-triton` (the
suite with the draft head on that backend; `nox -t tests` runs all four), `nox -s lint`, `nox -s bench`,
`nox -s gpu` (exactness and speed of every stack on a CUDA GPU; skips without one).

Sessions run in the current environment (torch is large; a CPU build is installed once, see the
README), with the package installed editable.
"""

import nox

nox.options.sessions = [*(f"tests-{b}" for b in ["torch", "torch-blocked", "int8-blocked", "triton"]), "lint"]

BACKENDS = ["torch", "torch-blocked", "int8-blocked", "triton"]
#: Triton runs under its CPU interpreter here, which is slow: its session runs the exactness and
#: backend tests rather than the whole suite.
TRITON_TESTS = ["tests/test_exactness.py", "tests/test_triton_backend.py", "tests/test_backends.py",
                "-k", "llama or backend or kernel or triton"]


def _tests(session: nox.Session, backend: str) -> None:
    session.run("python", "-m", "pip", "install", "--quiet", "-e", ".[test,data]", external=True)
    selection = TRITON_TESTS if backend == "triton" and not session.posargs else session.posargs
    session.run("python", "-m", "pytest", "-q", "-m", "not slow", *selection,
                env={"DYNASPEC_TEST_BACKEND": backend, "TRITON_INTERPRET": "1"})


# one session per backend, named tests-<backend>; `nox -t tests` runs them all
def _session_for(backend: str):
    def run(session: nox.Session) -> None:
        _tests(session, backend)

    run.__doc__ = f"the test suite with the engine's draft head on the {backend} backend"
    return nox.session(name=f"tests-{backend}", venv_backend="none", tags=["tests"])(run)


for _backend in BACKENDS:
    _session_for(_backend)


@nox.session(venv_backend="none")
def lint(session: nox.Session) -> None:
    """ruff over the sources and tests (ruff comes with the test extra)."""
    session.run("python", "-m", "pip", "install", "--quiet", "-e", ".[test]", external=True)
    session.run("ruff", "check", "core", "plugins", "shortlisters", "schedulers", "tests", "noxfile.py",
                external=True)


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """The benchmarks on the embedded default: draft-head time per backend against shortlist size
    (with the per-draft-step breakdown), then the stacks side by side on the built-in prompt set.
    Figures and plots go to `bench-out/`."""
    session.run("python", "-m", "pip", "install", "--quiet", "-e", ".", external=True)
    session.run("dynaspec", "bench-head", "--threads", "1", "--backends", "torch", "torch-blocked", "int8-blocked",
                "--breakdown", "qwen-eagle-chain", "qwen-dynaspec",
                "--out", "bench-out/head", external=True)
    session.run("dynaspec", "bench", "--threads", "1", "--stacks", "default", "qwen-eagle-chain", "qwen-fr-spec", "qwen-dynaspec",
                "--limit-per-category", "1", "--max-new-tokens", "64", "--out", "bench-out/bench",
                *session.posargs, external=True)


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """On a CUDA machine: every built-in stack on the target's GPU, greedy, each output checked
    token for token against plain decoding on the same GPU, with tokens/s against it and the cost
    model. Skips (with the reason) where there is no CUDA GPU. Uses the current environment's torch,
    which must be a CUDA build there."""
    import subprocess
    import sys

    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                           capture_output=True, text=True)
    if probe.stdout.strip() != "True":
        session.skip("no CUDA GPU here (torch.cuda.is_available() is not True): nothing to check")
    session.run("python", "-m", "pip", "install", "--quiet", "-e", ".[data,triton]", external=True)
    stacks = ["default", "gemma", "eagle-chain", "fr-spec", "fr-spec-pa", "dynaspec", "dynaspec-fixed",
              "dynaspec-confidence", "dynaspec-context", "dynaspec-hybrid-context", "eagle"]
    session.run("dynaspec", "eval", "--device", "cuda", "--prompts", "8", "--stacks", *stacks,
                *session.posargs, external=True)
