"""Exceptions shared by every drivetrain package, so callers can catch them by kind."""

from __future__ import annotations


class DrivetrainError(Exception):
    """Base class of every error drivetrain raises on purpose."""


class PluginError(DrivetrainError):
    """A plugin is unknown, disabled, failed to import, or implements another api version."""


class EngineStateError(DrivetrainError):
    """An engine method was called in a state that forbids it (e.g. forward_backward outside
    ``train_mode()``, or before ``initialize()``)."""


class BatchError(DrivetrainError, ValueError):
    """A batch is malformed: ragged columns, offsets that do not match, unknown column type."""


class ConfigError(DrivetrainError, ValueError):
    """A configuration value or key is invalid; the message names the valid choices."""


class RolloutStalled(DrivetrainError):
    """A rollout is alive but silent: it answered nothing, or produced no token while requests
    ran on it, for longer than its progress deadline (``rollout.stall_timeout_s``)."""
