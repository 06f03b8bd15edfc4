"""The front door's words: a config Hydra cannot compose is refused in usp's one line (a key
the schema lacks with "did you mean", in an override, a list of dicts or a user's recipe),
and ``cluster=`` takes a file. The commands' exit codes: ``e2e/test_inputs_commands.py``."""

from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException

import usp.cli as cli
from usp.hydra_app import cluster_file_overrides, config_error

H100 = Path(cli.CONFIG_DIR) / "cluster" / "h100_ib.yaml"


@pytest.fixture
def refusal():
    """``refusal(*overrides)``: config_error's line for a usp-train config Hydra refuses."""
    def refuse(*overrides):
        with initialize_config_dir(config_dir=cli.CONFIG_DIR, version_base="1.3"):
            with pytest.raises(HydraException) as e:
                compose("train", overrides=list(overrides))
        return str(config_error(e.value, overrides))
    return refuse


def _own_dir(tmp_path: Path) -> Path:
    """A user's config folder: a cluster file (h100_ib renamed, 3 nodes) and a recipe."""
    (tmp_path / "cluster").mkdir()
    (tmp_path / "recipe").mkdir()
    spec = yaml.safe_load(H100.read_text()) | {"name": "mine", "nodes": 3}
    (tmp_path / "cluster" / "mine.yaml").write_text(yaml.safe_dump(spec))
    (tmp_path / "recipe" / "typo.yaml").write_text("# @package _global_\ntrainer:\n  step: 5\n")
    return tmp_path


@pytest.mark.parametrize("overrides,line", [
    (["trainer.step=5"], "unknown config key trainer.step (did you mean trainer.steps?): the "
                         "schema has no such field; drop the override or fix its name"),
    (["node=2"], "unknown config key node ("),
    (["data=memmap", "data.blend=[{path:a,wieght:2}]"],
     "unknown config key data.blend[0].wieght (did you mean data.blend[0].weight?)"),
    (["trainer.phases=[{seq_len:8,stpes:2}]"],
     "unknown config key trainer.phases[0].stpes (did you mean trainer.phases[0].steps?)"),
    (["trainer.phases=[{seq_len:8,steps:2},{seq_len:16,steps:2,rope_thetta:4e4}]"],
     "unknown config key trainer.phases[1].rope_thetta (did you mean "
     "trainer.phases[1].rope_theta?)"),
    (["trainer.phases=[{seq_len:8,steps:2},{seq_len:16,steps:2,until:{passkey_ac:0.9}}]"],
     "unknown config key trainer.phases[1].until.passkey_ac (did you mean "
     "trainer.phases[1].until.passkey_acc?)"),
])
def test_a_key_the_schema_lacks_gets_usps_message(refusal, overrides, line):
    text = refusal(*overrides)
    assert text.startswith(line) and "\n" not in text and "+trainer" not in text


def test_a_key_in_a_users_recipe_names_the_recipe(refusal, tmp_path):
    text = refusal(f"hydra.searchpath=[file://{_own_dir(tmp_path)}]", "recipe=typo")
    assert text == ("unknown config key trainer.step (did you mean trainer.steps?) in "
                    "recipe/typo: the schema has no such field; fix its name there")


def test_other_composition_errors_are_one_line(refusal):
    missing = refusal("model=nosuch")
    assert missing.startswith("In 'train': Could not find 'model/nosuch'; options in 'model': ")
    assert missing.endswith("qwen2_7b, tiny; an option of your own: --config-dir DIR with "
                            "DIR/model/NAME.yaml") and "\n" not in missing
    assert refusal("trainer.steps=abc") == ("Error merging override trainer.steps=abc; Value 'abc' "
                                            "of type 'str' could not be converted to Integer")


def test_a_cluster_file_is_an_option_of_the_cluster_group(tmp_path):
    path = _own_dir(tmp_path) / "cluster" / "mine.yaml"
    args = cluster_file_overrides(["cluster=" + str(path), "trainer.steps=2"])
    assert args == ["cluster=path:mine", "trainer.steps=2"]
    with initialize_config_dir(config_dir=cli.CONFIG_DIR, version_base="1.3"):
        cfg = cli.to_config(compose("train", overrides=args))
        # a recipe's cluster values apply on top of the file, as on top of a packaged cluster
        recipe = cli.to_config(compose("train", overrides=args + ["recipe=llama3_8b_128k_h100x16"]))
    assert (cfg.cluster.name, cfg.cluster.nodes, cfg.cluster.inter_bw) == ("mine", 3, 50e9)
    assert (recipe.cluster.name, recipe.cluster.nodes) == ("mine", 2)
    with pytest.raises(ValueError, match=r"cluster=nowhere.yaml: no such file; give the path of "
                                         r"a cluster YAML .* or one of a100_ib, cpu_local"):
        cluster_file_overrides(["cluster=nowhere.yaml"])


def test_a_refusal_removes_only_a_run_directory_of_hydras_own_files(tmp_path):
    """What ``forget_run_dir`` removes: the folders Hydra made, when they hold only its
    ``.hydra/`` files and an empty log; a directory with anything else stays whole."""
    from omegaconf import OmegaConf

    from usp.hydra_app import RunDirRecord, forget_run_dir, keep_run_dir

    def made(run_dir, extra=None):
        RunDirRecord().on_run_start(OmegaConf.create({"hydra": {"run": {"dir": str(run_dir)}}}))
        (run_dir / ".hydra").mkdir(parents=True)
        for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
            (run_dir / ".hydra" / name).write_text("x: 1\n")
        (run_dir / "cli.log").write_text("")
        if extra:
            (run_dir / extra).write_text("a run's file\n")

    made(tmp_path / "new" / "runs" / "now")
    forget_run_dir()
    assert sorted(tmp_path.iterdir()) == []  # new/ and runs/ were Hydra's too
    made(tmp_path / "runs" / "now", extra="metrics.jsonl")
    forget_run_dir()
    assert (tmp_path / "runs" / "now" / ".hydra" / "config.yaml").is_file()
    made(tmp_path / "kept" / "now")
    keep_run_dir()  # the run was accepted: a later refusal keeps it
    forget_run_dir()
    assert (tmp_path / "kept" / "now" / "cli.log").is_file()
