"""Tables of installed plugins for ``drivetrain engines|rollouts|ckpt-engines``."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from drivetrain.api.registry import Registry, Status

_STATUS_STYLE = {Status.OK: "green", Status.DISABLED: "yellow"}


def plugin_table(registry: Registry) -> Table:
    """Import every plugin of ``registry`` and tabulate what it is and whether it works."""
    table = Table(title=f"drivetrain {registry.kind}s ({registry.group})", title_justify="left")
    for column in ("name", "distribution", "api", "capabilities", "status"):
        table.add_column(column, overflow="fold")
    for record in registry.inspect(load=True):
        spec = record.spec
        style = _STATUS_STYLE.get(record.status, "red")
        table.add_row(  # Text, not markup: an import error may hold "[...]"
            Text(record.name),
            Text(f"{record.distribution} {record.version}".strip()),
            Text(spec.api if spec else "?"),
            Text(", ".join(sorted(spec.capabilities)) if spec else ""),
            Text(record.describe(), style=style),
        )
    return table
