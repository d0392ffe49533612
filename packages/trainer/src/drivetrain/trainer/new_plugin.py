"""``drivetrain new-plugin KIND NAME``: a package folder for a third-party plugin whose kit
passes on its own working stub (``plugin_templates/KIND``: files with ``${placeholders}``,
``MODULE`` in a path standing for the Python package's name)."""

from __future__ import annotations

import re
import string
from pathlib import Path

from drivetrain.api.errors import DrivetrainError

TEMPLATES = Path(__file__).with_name("plugin_templates")
_NAME = re.compile(r"[a-z][a-z0-9]*(-[a-z0-9]+)*")


def kinds() -> list[str]:
    """The kinds of plugin a template exists for."""
    return sorted(p.name for p in TEMPLATES.iterdir() if p.is_dir())


def new_plugin(kind: str, name: str, into: Path) -> Path:
    """Write the package ``into/name`` from the ``kind`` template; returns its folder."""
    if kind not in kinds():
        raise DrivetrainError(f"no template for {kind!r}; kinds: {', '.join(kinds())}")
    if not _NAME.fullmatch(name):
        raise DrivetrainError(
            f"plugin name {name!r}: lowercase letters and digits, words joined by '-' "
            "(e.g. acme-words)"
        )
    target = into / name
    if target.exists():
        raise DrivetrainError(f"{target} exists: choose another name or folder")
    module = name.replace("-", "_")
    values = {
        "name": name,
        "module": module,
        "plugin": module,
        "classname": "".join(part.capitalize() for part in name.split("-")),
        "title": name.replace("-", " ").capitalize(),
    }
    root = TEMPLATES / kind
    for source in sorted(root.rglob("*.tmpl")):
        relative = source.relative_to(root).with_suffix("")  # drop .tmpl
        path = target / Path(*(module if p == "MODULE" else p for p in relative.parts))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(string.Template(source.read_text()).substitute(values))
    return target
