"""A wheel built from this tree installs into a fresh environment and works from any directory."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOT_SOURCES = shutil.ignore_patterns(".git", "outputs", "build", "dist", "*.egg-info", "__pycache__", ".*_cache")


def run(*command: str | Path, cwd: Path) -> str:
    """Run outside this checkout: no PYTHONPATH pointing into it, a directory with no conf/ or recipes/."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run([str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done.stdout


@pytest.mark.slow
def test_wheel_installs_and_plans_outside_the_repository(tmp_path):
    source = tmp_path / "source"  # a copy, so the build's build/ and egg-info stay out of the checkout
    shutil.copytree(REPO, source, ignore=NOT_SOURCES)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        tmp_path,
        source,
        cwd=elsewhere,
    )
    wheel = next(tmp_path.glob("holmes_lightning-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "holmes_lightning/conf/cluster/two_cluster_mixed.yaml" in names
    assert "holmes_lightning/recipes/gpt.py" in names
    assert not [name for name in names if name.split("/")[0] in ("recipes", "conf", "tests")]

    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv, cwd=elsewhere)
    # the wheel's dependencies from wherever this interpreter has them (a venv or the system), not reinstalled: its
    # site directories as plain paths, so the checkout's own editable install there does not come along
    (inner,) = (venv / "lib").glob("python*/site-packages")
    (inner / "outer_packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    run(venv / "bin" / "python", "-m", "pip", "install", "--no-deps", "-q", wheel, cwd=elsewhere)
    imported = run(
        venv / "bin" / "python", "-c", "import holmes_lightning; print(holmes_lightning.__file__)", cwd=elsewhere
    )
    assert imported.startswith(str(venv)), imported

    plan = run(venv / "bin" / "holmes-plan", "cluster=two_cluster_mixed", "model=gpt_tiny", cwd=elsewhere)
    assert "Topology 'two_cluster_mixed'" in plan and "predicted step" in plan
    assert "usage: holmes-launch cluster=NAME" in run(venv / "bin" / "holmes-launch", "--help", cwd=elsewhere)
    recipe = run(
        venv / "bin" / "python", "-c", "from holmes_lightning.recipes import GPT; print(GPT.__module__)", cwd=elsewhere
    )
    assert recipe.strip() == "holmes_lightning.recipes.gpt"


def test_readme_leads_with_the_example_script():
    """README's first snippet is recipes/train_my_model.py as it runs (so the snippet runs as written)."""
    readme = (REPO / "README.md").read_text()
    snippet = readme.split("```python\n", 1)[1].split("```", 1)[0]
    script = (REPO / "recipes" / "train_my_model.py").read_text()
    assert script.endswith(snippet) and "HolmesStrategy(" in snippet


def test_readmes_hugging_face_snippet_is_the_recipe_as_it_runs():
    """README's second snippet is the end of recipes/train_hf_llama.py (tests/test_hf_pipeline.py runs it)."""
    readme = (REPO / "README.md").read_text()
    snippet = readme.split("```python\n")[2].split("```", 1)[0]
    script = (REPO / "recipes" / "train_hf_llama.py").read_text()
    assert script.endswith(snippet) and "class MyLlama(HFCausalLM)" in snippet and len(snippet.splitlines()) < 20
