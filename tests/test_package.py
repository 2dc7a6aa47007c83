"""The package as a user installs it: a built wheel (not an editable install) carries the configs and prompt sets,
its console scripts run from any directory, and the import-linter contracts (pyproject.toml) hold."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO, tiny_llama
from tests.stubs import VOCAB, save_tiny


def run(cmd: list[str], cwd: Path, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "PYTHONPATH": "", **(env or {})}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory) -> Path:
    """A venv that sees the system site-packages (torch, transformers ...) with the wheel installed, no deps."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"  # build from a copy: the checkout's build/ and egg-info stay untouched
    top_level = {".git", "checkpoints", "data", "build", "outputs", "multirun", "tests"}  # the package has data/ too
    anywhere = shutil.ignore_patterns("*.egg-info", "__pycache__", ".venv*")
    shutil.copytree(REPO, src, ignore=lambda folder, names: anywhere(folder, names)
                    | ({*names} & top_level if Path(folder) == REPO else set()))
    built = run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(root / "dist")], src)
    assert built.returncode == 0, built.stderr[-2000:]
    wheel = next((root / "dist").glob("drafter_train-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "drafter_train/conf/train.yaml" in names and "drafter_train/conf/drafter/eagle3.yaml" in names
    assert {"drafter_train/prompts/dev.jsonl", "drafter_train/prompts/test.jsonl"} <= set(names)
    env_dir = root / "venv"
    venv.create(env_dir, system_site_packages=True, with_pip=False)
    installed = run([sys.executable, "-m", "pip", "--python", str(env_dir / "bin" / "python"), "install", "-q",
                     "--no-deps", "--no-index", "--force-reinstall", str(wheel)], root)
    assert installed.returncode == 0, installed.stderr[-2000:]
    return env_dir


def test_the_wheel_runs_from_outside_the_checkout(wheel_venv, tmp_path):
    bin_dir = wheel_venv / "bin"
    where = run([str(bin_dir / "python"), "-c", "import drafter_train; print(drafter_train.__file__)"], tmp_path)
    assert Path(where.stdout.strip()).is_relative_to(wheel_venv), where.stdout + where.stderr  # not the checkout
    helped = run([str(bin_dir / "drafter-train"), "--help"], tmp_path)
    assert helped.returncode == 0 and "drafter" in helped.stdout, helped.stderr[-2000:]
    # A tiny job: prompt lookup on a tiny target, on the package's own held-out prompts, from another directory.
    save_tiny(tiny_llama(vocab_size=VOCAB, num_layers=2), tmp_path / "target")
    job = run([str(bin_dir / "drafter-eval"), f"target.path={tmp_path / 'target'}", "target.chat_template=false",
               "target.cpu_kernels=default", "drafter=ngram", "eval.prompts=heldout-mix", "eval.num_prompts=2",
               "eval.max_new_tokens=6", "eval.warmup=0", f"eval.output={tmp_path / 'metrics.json'}"], tmp_path)
    assert job.returncode == 0, job.stderr[-2000:]
    assert (tmp_path / "metrics.json").is_file()
    # drafter-compare from the wheel: its jobs composed from the packaged configs, refused in one line before loading
    refused = run([str(bin_dir / "drafter-compare"), f"target.path={tmp_path / 'target'}", "a:", "drafter=ngram",
                   "eval.output=a.json", "b:", "drafter=ngram", "eval.output=b.json", "eval.seed=1"], tmp_path)
    assert refused.returncode == 2 and "b: eval.seed=1 differs" in refused.stderr, refused.stderr[-2000:]


def test_the_readme_is_read_in_five_minutes():
    """README.md stays <= 200 lines (docs/STYLE: detail goes to docs/), and every docs/ page it links exists."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200, f"README.md has {len(readme.splitlines())} lines: move detail to docs/"
    linked = re.findall(r"\]\((docs/[^)#]+)", readme)
    assert linked and [page for page in linked if not (REPO / page).exists()] == []


def test_import_contracts_hold():
    lint = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    linted = run([lint, "--config", str(REPO / "pyproject.toml")], REPO, env={"PYTHONPATH": str(REPO)})
    assert linted.returncode == 0, linted.stdout[-3000:]
    assert "broken" in linted.stdout and " 0 broken" in linted.stdout


def test_a_user_config_folder_adds_options(tmp_path):
    """hydra.searchpath adds a user's own config folder: here a drafter preset that lives outside the package."""
    (tmp_path / "conf" / "drafter").mkdir(parents=True)
    (tmp_path / "conf" / "drafter" / "my_lookup.yaml").write_text("defaults:\n  - ngram_schema\n  - _self_\n\nmin_ngram: 2\n")
    shown = run([sys.executable, "-c", "from drafter_train.recipes.cli import eval_main; eval_main()",
                 f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "drafter=my_lookup", "--cfg", "job"], tmp_path,
                env={"PYTHONPATH": str(REPO)})
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "min_ngram: 2" in shown.stdout and "kind: ngram" in shown.stdout
