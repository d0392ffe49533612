"""Tables of installed plugins for ``drivetrain engines|rollouts|ckpt-engines|environments``."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from drivetrain.api.registry import PluginRecord, Registry, Status

_STATUS_STYLE = {Status.OK: "green", Status.DISCOVERED: "green", Status.DISABLED: "yellow"}


def _status(record: PluginRecord) -> str:
    if record.status is Status.DISCOVERED:  # the spec checked out; the code was not imported
        return "installed"
    return record.describe()


def plugin_table(registry: Registry, *, check: bool = False) -> Table:
    """Tabulate what each plugin of ``registry`` declares and whether it can be used. Only
    entry-point metadata and the light spec modules are read (no torch), unless ``check``:
    then every plugin's code is imported and the status says whether that worked."""
    how = (
        "each plugin's code imported"
        if check
        else "status from metadata and specs only; --check imports each plugin's code"
    )
    table = Table(
        title=f"drivetrain {registry.kind}s ({registry.group})",
        title_justify="left",
        caption=how,
        caption_justify="left",
    )
    for column in ("name", "distribution", "api", "capabilities", "status"):
        table.add_column(column, overflow="fold")
    for record in registry.inspect(load=check):
        spec = record.spec
        table.add_row(  # Text, not markup: an import error may hold "[...]"
            Text(record.name),
            Text(f"{record.distribution} {record.version}".strip()),
            Text(spec.api if spec else "?"),
            Text(", ".join(sorted(spec.capabilities)) if spec else ""),
            Text(_status(record), style=_STATUS_STYLE.get(record.status, "red")),
        )
    return table
