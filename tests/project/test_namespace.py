"""Everything Arbiter installs imports under one name, ``arbiter``: it runs beside other agent frameworks.

The OpenAI Agents SDK installs the top-level package ``agents`` (Arbiter's SDK once had that name
too). The built wheel is installed into a fresh virtual environment next to it, and both import.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(REPO)], check=True, timeout=300)
    (built,) = out.glob("arbiter-*.whl")
    return built


def test_the_wheel_holds_one_top_level_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"arbiter"}, sorted(tops)
    # Each folder's portion of the namespace is packed under arbiter/ (pyproject.toml's sources).
    for module in ("arbiter/schemas/codec.py", "arbiter/schemas/lock/lock_requested.avsc", "arbiter/edge/settings.py",
                   "arbiter/streams/cores/leases.py", "arbiter/agents/client.py", "arbiter/kafka/pom.xml"):
        assert module in names, module


def test_arbiter_and_the_openai_agents_sdk_import_side_by_side(wheel: Path, tmp_path: Path) -> None:
    """A fresh venv: the wheel (no dependencies), and this environment's packages (openai-agents among them)
    for its dependencies, but not this checkout."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    here = sysconfig.get_paths()["purelib"]
    (site / "deps.pth").write_text(here + "\n")  # dependencies only: a path entry does not run the .pth files there
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(site),
                    str(wheel)], check=True, timeout=300)
    probe = f"""
import agents, arbiter.agents
from agents import Agent, Runner
from arbiter.agents import ArbiterClient
assert agents.__file__.startswith({here!r}), agents.__file__
assert arbiter.agents.__file__.startswith({str(site)!r}), arbiter.agents.__file__
print(Agent.__module__, ArbiterClient.__module__)
"""
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["agents.agent", "arbiter.agents.client"]
    installed = {p.name for p in site.iterdir()} - {"deps.pth", "__pycache__"}
    assert {n for n in installed if not n.endswith(".dist-info")} <= {"arbiter", "bin"}, sorted(installed)


def test_a_source_checkout_resolves_agents_to_the_framework_not_to_the_folder(tmp_path: Path) -> None:
    """In this (editable) environment the checkout is on the path too; ``agents`` is still the framework's."""
    done = subprocess.run([sys.executable, "-c", "import agents, arbiter.agents; print(agents.__file__); "
                           "print(arbiter.agents.__file__)"], capture_output=True, text=True, cwd=tmp_path,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    framework, ours = done.stdout.split()
    assert "site-packages" in framework and not framework.startswith(str(REPO / "agents")), framework
    assert ours.startswith(str(REPO)), ours


def test_a_script_run_from_the_checkouts_root_never_gets_arbiters_sdk_as_agents() -> None:
    """Python puts a script's folder first on the path: from the checkout's root, ``agents/`` holds no module
    of Arbiter's (its SDK is agents/arbiter/agents), so ``import agents`` is still the framework's."""
    done = subprocess.run([sys.executable, "-c", "import agents; print(agents.__file__); print(hasattr(agents, "
                           "'ArbiterClient'))"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    framework, has_ours = done.stdout.split()
    assert "site-packages" in framework and has_ours == "False", done.stdout
