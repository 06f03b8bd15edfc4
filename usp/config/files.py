"""Where the YAML configs are: ``CONFIG_DIR``, the package's ``_configs`` folder.

In the repository the files live at the top, in ``configs/`` (its ``recipe`` group is
``recipes/``), and ``usp/_configs`` is a link to ``configs/``; a wheel holds the files
themselves in ``usp/_configs`` (``[tool.setuptools.package-data]`` in pyproject.toml). The
folder is found through the package, so the checkout, an editable install and a wheel
installed anywhere read the same files. A user's own config folder is added with Hydra's
``--config-dir`` or ``hydra.searchpath`` (docs/configuration.md), never by editing these.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

CONFIG_DIR = Path(str(files("usp") / "_configs"))
