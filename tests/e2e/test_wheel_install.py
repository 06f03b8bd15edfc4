"""usp installed from a wheel (not editable), or editable, finds its configs through the
package: ``usp-train`` and ``usp-plan`` run from a folder outside the checkout.

The wheel is built offline from a copy of the files it is made of; the fresh venv reuses the
test venv's packages (torch, hydra, ...) through a ``.pth`` line added after usp is installed,
so pip never sees the test venv's own usp and the wheel's usp is the one imported."""

import os
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "usp", "configs", "recipes")  # what the wheel holds
PLAN = ["model=llama3_8b", "cluster=h100_ib", "nodes=4", "data.seq_len=1048576"]


def _copy_sources(dst: Path) -> Path:
    """The files a wheel is built from, links kept (usp/_configs -> configs)."""
    junk = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    dst.mkdir()
    for name in SOURCES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dst / name, symlinks=True, ignore=junk)
        else:
            shutil.copy2(src, dst / name)
    return dst


def _env() -> dict:
    """The environment of a user's shell: no PYTHONPATH to the checkout, no launcher."""
    drop = ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM", "MASTER_")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


def _pip(env_dir: Path, *args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--python", str(env_dir / "bin" / "python"),
                    "-q", "--disable-pip-version-check", *args],
                   check=True, env=_env(), capture_output=True, text=True, timeout=300)


def _fresh_venv(env_dir: Path, wheel: str) -> Path:
    """A venv with usp installed by ``pip install --no-deps --no-index wheel``, then the
    test venv's site-packages appended to its path. Its python."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(env_dir)
    _pip(env_dir, "install", "--no-deps", "--no-index", wheel)
    python = env_dir / "bin" / "python"
    own = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True, env=_env()).stdout.strip()
    # plain path lines: the test venv's .pth files (its editable usp's finder) are not run
    Path(own, "test_venv_packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python


def _run(cmd: list, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, cwd=cwd, env=dict(_env(), PYTHONUNBUFFERED="1"),
                         capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{cmd}: {res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    return res


def _usp_location(python: Path, cwd: Path) -> tuple[Path, Path]:
    out = _run([str(python), "-c", "import usp, usp.cli as c; print(usp.__file__); "
                "print(c.CONFIG_DIR)"], cwd).stdout.split()
    return Path(out[0]), Path(out[1])


def test_a_wheel_runs_usp_train_and_usp_plan_outside_the_checkout(tmp_path):
    src = _copy_sources(tmp_path / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-index",
                    "--no-build-isolation", "--disable-pip-version-check", "-w",
                    str(tmp_path / "dist"), str(src)],
                   check=True, env=_env(), capture_output=True, text=True, timeout=300)
    wheel, = (tmp_path / "dist").glob("usp-*.whl")
    env_dir = tmp_path / "venv"
    python = _fresh_venv(env_dir, str(wheel))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    module, configs = _usp_location(python, elsewhere)
    assert module.is_relative_to(env_dir), module  # the wheel's usp, not the checkout's
    assert configs.is_relative_to(env_dir) and not configs.is_symlink(), configs
    assert (configs / "recipe" / "tiny_cpu.yaml").is_file()  # recipes/ ship as the group

    plan = _run([str(env_dir / "bin" / "usp-plan"), *PLAN], elsewhere)
    assert "1048576" in plan.stdout.replace(",", "") and "h100_ib" in plan.stdout, plan.stdout
    train = _run([str(env_dir / "bin" / "usp-train"), "trainer.steps=2"], elsewhere)
    assert "done: step 2," in train.stdout, train.stdout[-2000:]
    assert len(list(elsewhere.glob("runs/*/metrics.jsonl"))) == 1  # the run wrote where it ran


def test_an_editable_install_finds_the_checkouts_configs(tmp_path):
    src = _copy_sources(tmp_path / "src")
    # pip install -e's own step, with the test venv's setuptools (the fresh venv has none)
    made = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                           "print(build_meta.build_editable(sys.argv[1]))", str(tmp_path / "dist")],
                          cwd=src, check=True, env=_env(), capture_output=True, text=True,
                          timeout=300).stdout.split()[-1]
    python = _fresh_venv(tmp_path / "venv", str(tmp_path / "dist" / made))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    module, configs = _usp_location(python, elsewhere)
    assert module.resolve().is_relative_to(src), module
    assert configs.resolve() == (src / "configs").resolve()
    plan = _run([str(tmp_path / "venv" / "bin" / "usp-plan"), *PLAN], elsewhere)
    assert "h100_ib" in plan.stdout
