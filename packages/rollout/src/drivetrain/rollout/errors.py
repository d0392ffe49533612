"""Errors of the rollout backends."""

from __future__ import annotations

from drivetrain.api.errors import DrivetrainError, PluginError


class BackendNotInstalledError(PluginError):
    """The selected backend's library is not importable in this environment."""


class RolloutProcessError(DrivetrainError):
    """A rollout server process failed to start, died, or stopped answering."""


class ProtocolError(RolloutProcessError):
    """A message on the rollout server connection is not drivetrain wire data (it is refused,
    never unpickled)."""
