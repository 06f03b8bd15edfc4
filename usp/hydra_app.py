"""What ``usp-train``, ``usp-plan`` and ``usp-eval`` give Hydra and how its refusals read;
``usp.cli`` runs the Hydra app and calls these (none of them calls back into it).

- ``cluster=PATH.yaml``: a cluster file anywhere becomes an option of the ``cluster`` group
  (``cluster_file_overrides``), checked and overridden like ``cluster=h100_ib``.
- A config Hydra cannot compose (a misspelt key, a missing option, a value of the wrong
  type, in an override or in a user's recipe) is refused as usp refuses a bad value: one
  line ``usp-...: error: ...`` and exit 2 (``config_error``), where Hydra would print its
  own lines and exit 1. A key the schema lacks gets ``stray_key``'s "did you mean ...?",
  the same words as ``usp.cli.unknown_keys`` for keys added with ``+``.
- A command refused once Hydra made its run directory leaves nothing behind: ``RunDirRecord``
  notes what Hydra makes, ``forget_run_dir`` removes it, ``keep_run_dir`` keeps it once the
  command started its work.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Iterable
from pathlib import Path

import yaml
from hydra.core.config_store import ConfigStore
from hydra.experimental.callback import Callback
from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from .config.files import CONFIG_DIR

_DETAILS = ("full_key:", "reference_type=", "object_type=")  # OmegaConf's context lines


def stray_key(name: str, key: str, known: Iterable[str], prefix: str = "") -> str:
    """``name (did you mean {prefix}{closest}?)`` for a key the schema lacks, or the known
    keys when none is close."""
    known = sorted(known)
    near = difflib.get_close_matches(str(key), known, n=1)
    return f"{name} ({f'did you mean {prefix}{near[0]}?' if near else 'known: ' + ', '.join(known)})"


def unknown_key_error(stray: list[str], where: str = "") -> ValueError:
    """The refusal of keys the schema lacks (``stray_key`` lines), from the command line or,
    with ``where``, from that config file."""
    fix = "fix its name there" if where else "drop the override or fix its name"
    return ValueError(f"unknown config key {'; '.join(stray)}{f' in {where}' if where else ''}: "
                      f"the schema has no such field; {fix}")


def cluster_file_overrides(args: list[str]) -> list[str]:
    """``args`` with each ``cluster=PATH`` (a ``.yaml``/``.yml`` file) replaced by
    ``cluster=path:STEM``, the file stored as that option of the ``cluster`` group; the
    other arguments as they are. ValueError for a file that is not there or not YAML."""
    out = []
    for arg in args:
        key, eq, value = arg.partition("=")
        if eq and key.lstrip("+") == "cluster" and value.endswith((".yaml", ".yml")):
            path = Path(value).expanduser()
            if not path.is_file():
                known = ", ".join(sorted(p.stem for p in (CONFIG_DIR / "cluster").glob("*.yaml")))
                raise ValueError(f"cluster={value}: no such file; give the path of a cluster "
                                 f"YAML (the fields of {CONFIG_DIR / 'cluster' / 'h100_ib.yaml'}) "
                                 f"or one of {known}")
            try:
                node = OmegaConf.load(path)
            except (OSError, yaml.YAMLError) as e:
                raise ValueError(f"cluster={value}: not a readable YAML file: {e}") from e
            arg = f"{key}=path:{path.stem}"
            ConfigStore.instance().store(group="cluster", name=arg.partition("=")[2], node=node)
        out.append(arg)
    return out


def _key_path(value, key: str, at: str) -> str | None:
    """The dotted path (``at[1].key``) of the first dict in ``value`` (lists and dicts of
    them) that holds ``key``, or None."""
    if isinstance(value, dict):
        if key in value:
            return f"{at}.{key}"
        items = [(f"{at}.{k}", v) for k, v in value.items()]
    elif isinstance(value, list):
        items = [(f"{at}[{i}]", v) for i, v in enumerate(value)]
    else:
        return None
    return next((p for p in (_key_path(v, key, where) for where, v in items) if p), None)


def _key_in_override(key: str, override: str, overrides: Iterable[str]) -> str | None:
    """Where ``key`` sits in the value the command line gave ``override`` (a list of dicts:
    ``trainer.phases[1].rope_thetta``), or None when it cannot be found there."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    for text in overrides:
        if text.partition("=")[0].lstrip("+~") != override:
            continue
        try:
            value = OverridesParser.create().parse_override(text).value()
        except Exception:  # noqa: BLE001 -- Hydra's own refusal of the text stands
            return None
        return _key_path(value, key, override)
    return None


def config_error(e: Exception, overrides: Iterable[str] = ()) -> ValueError:
    """Hydra's refusal ``e`` of a config it could not compose (from the command line
    ``overrides``), as one line."""
    text = str(e).split("\nConfig search path:")[0]
    found = re.match(r"In '([^']+)': ", text)
    where = found.group(1) if found and found.group(1) not in ("train", "plan") else ""
    cause = e.__cause__ or e.__context__
    while cause is not None and not isinstance(cause, OmegaConfBaseException):
        cause = cause.__cause__ or cause.__context__
    schema = getattr(cause, "object_type", None)
    if (isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and dataclasses.is_dataclass(schema)
            and cause.key not in {f.name for f in dataclasses.fields(schema)}):
        name = cause.full_key
        override = re.search(r"override '?\+*([\w.]+)", text)
        if override and not name.startswith(override.group(1)):  # an item of a list of dicts
            name = (_key_in_override(str(cause.key), override.group(1), overrides)
                    or f"{name} in {override.group(1)}")
        known = [f.name for f in dataclasses.fields(schema)]
        prefix = name[:len(name) - len(str(cause.key))] if name.endswith(str(cause.key)) else ""
        return unknown_key_error([stray_key(name, cause.key, known, prefix)], where)
    head, _, options = text.partition("\n\nAvailable options in ")
    said = (getattr(cause, "msg", None) or str(cause)) if cause is not None else ""
    if said not in head:  # OmegaConf's reason, when Hydra's text leaves it out
        head += "\n" + said
    lines = [line.strip().rstrip(":") for line in head.splitlines()
             if line.strip() and not line.strip().startswith(_DETAILS)]
    if options:  # a group option that is in no config folder
        group, _, names = options.partition(":")
        folder = group.strip("'")
        lines.append(f"options in {group}: {', '.join(names.split())}; an option of your own: "
                     f"--config-dir DIR with DIR/{folder}/NAME.yaml")
    return ValueError("; ".join(lines))


REFUSED = 2  # the exit status of a command refused before it started anything
_HYDRA_FILES = (".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml", ".hydra")


class RunDirRecord(Callback):
    """Hydra callback (``hydra.callbacks`` of configs/train.yaml and eval.yaml): before Hydra
    makes the run directory, note it and the outermost of its folders that does not exist
    yet, so that a refused command can remove what Hydra wrote there (``forget_run_dir``)."""

    made: list[tuple[Path, Path]] = []  # (run directory, its first folder Hydra makes)

    def on_run_start(self, config, **kwargs) -> None:
        run_dir = Path(str(config.hydra.run.dir)).absolute()  # ${now:} is cached: Hydra's
        top = run_dir
        while not top.parent.exists():
            top = top.parent
        RunDirRecord.made[:] = [(run_dir, top)] if not run_dir.exists() else []

    def on_run_end(self, config, **kwargs) -> None:
        keep_run_dir()


def keep_run_dir() -> None:
    """The command started its work (ranks, a run): a refusal from now on keeps the run
    directory, whatever is in it."""
    RunDirRecord.made.clear()


def _hydra_files_only(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds nothing but what Hydra writes there at the start: its
    ``.hydra/`` files and an empty job log."""
    for path in run_dir.rglob("*"):
        name = path.relative_to(run_dir).as_posix()
        if not (name in _HYDRA_FILES or (path.suffix == ".log" and path.parent == run_dir
                                         and path.stat().st_size == 0)):
            return False
    return True


def forget_run_dir() -> None:
    """After a refusal: remove the run directory Hydra made for this command and the folders
    it made above it, when the directory holds only Hydra's own files (``.hydra/``, an
    empty job log). A directory that existed before the command, or that holds anything
    else, is left alone; one another process removes first is no error."""
    for run_dir, top in RunDirRecord.made:
        try:
            if not run_dir.is_dir() or not _hydra_files_only(run_dir):
                continue
            for path in sorted(run_dir.rglob("*"), reverse=True):  # files before folders
                path.rmdir() if path.is_dir() else path.unlink(missing_ok=True)
            folder = run_dir
            while folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
                if folder == top:
                    break
                folder = folder.parent
        except OSError:  # a torchrun task of the same second removed it first
            pass
    keep_run_dir()
