"""Discovery and loading of engines, rollouts, weight-sync transports and RL environments from
entry points.

Discovery reads entry-point metadata only (no plugin code runs). ``spec(name)`` imports the
plugin's light spec module; ``load(name)`` imports its code, after checking that the plugin is
allowed, implements this engine-api version and declares the capabilities asked for. Every
failure is remembered and raised as one line that names the cause, the install command and
the installed alternatives, e.g.::

    unknown engine 'fsdp2': install it with pip install drivetrain-engine-fsdp; installed
    engines: megatron, megatron_fsdp (`drivetrain engines` shows their status)

``DRIVETRAIN_PLUGINS`` restricts what may load: a comma-separated list of names (``fsdp2``)
or group-qualified names (``engines:fsdp2``, ``environments:calculator``); a leading ``-``
denies instead (``-megatron``); ``none`` denies everything. With any allowed name listed, only
listed plugins load. Test doubles (an entry point whose spec lives in a ``testing`` module,
like the ``fake`` engine or the ``echo`` environment) are found only when
``DRIVETRAIN_TEST_PLUGINS=1`` (drivetrain-testing's pytest plugin sets it). Results are
cached per process, so loading is idempotent and cheap to repeat in every worker (Ray actors
included).
"""

from __future__ import annotations

import difflib
import enum
import importlib
import os
from collections.abc import Iterable
from dataclasses import dataclass, replace
from importlib import metadata
from typing import Any

from drivetrain.api.engine import Engine
from drivetrain.api.environment import Environment
from drivetrain.api.errors import PluginError
from drivetrain.api.first_party import INSTALL_HINTS
from drivetrain.api.plugin import PluginSpec
from drivetrain.api.rollout import Rollout
from drivetrain.api.version import API_VERSION, VersionRange
from drivetrain.api.weight_sync import WeightTransport

ENV_VAR = "DRIVETRAIN_PLUGINS"
TEST_PLUGINS_VAR = "DRIVETRAIN_TEST_PLUGINS"
GROUP_LABELS = ("engines", "rollouts", "ckpt_engines", "environments")


class Status(enum.Enum):
    DISCOVERED = "discovered"  # entry point seen, nothing imported yet
    OK = "ok"
    DISABLED = "disabled"
    FAILED = "failed to import"
    INCOMPATIBLE = "incompatible"
    INVALID = "invalid"
    CONFLICT = "conflict"


@dataclass(frozen=True)
class PluginRecord:
    """What the registry knows about one entry point."""

    group: str
    name: str
    target: str  # the entry point's value
    distribution: str
    version: str
    status: Status = Status.DISCOVERED
    reason: str = ""
    spec: PluginSpec | None = None

    @property
    def hint(self) -> str:
        if self.spec and self.spec.install_hint:
            return self.spec.install_hint
        return f"pip install --force-reinstall {self.distribution}" if self.distribution else ""

    def describe(self) -> str:
        text = self.status.value
        if self.reason:
            text += f": {self.reason}"
        if self.status in (Status.FAILED, Status.INVALID) and self.hint:
            text += f" ({self.hint})"
        return text


def _allowed(group_label: str, name: str, rules: str | None) -> tuple[bool, str]:
    """Apply ``DRIVETRAIN_PLUGINS`` to one plugin. An allow-list restricts a group only when it
    names plugins of that group (``engines:fsdp2``) or names plugins without a group."""
    if not rules or not rules.strip():
        return True, ""
    tokens = [t.strip() for t in rules.split(",") if t.strip()]
    if any(t.lower() == "none" for t in tokens):
        return False, f"{ENV_VAR} disables all plugins"
    parsed = []
    for token in tokens:
        deny = token.startswith("-")
        group, _, plugin = token.lstrip("-").rpartition(":")
        if group and group not in GROUP_LABELS:
            raise PluginError(
                f"{ENV_VAR}={rules}: unknown group {group!r} in {token!r}; "
                f"groups are {', '.join(GROUP_LABELS)}"
            )
        parsed.append((deny, group, plugin))
    if any(
        deny and plugin == name and group in ("", group_label) for deny, group, plugin in parsed
    ):
        return False, f"denied by {ENV_VAR}={rules}"
    allows = [(group, plugin) for deny, group, plugin in parsed if not deny]
    relevant = [plugin for group, plugin in allows if group in ("", group_label)]
    if relevant and name not in relevant:
        return False, f"not listed in {ENV_VAR}={rules}"
    return True, ""


def is_test_double(target: str) -> bool:
    """Whether an entry point's spec lives in a ``testing`` module or package (the ``fake``
    plugins): those exist for test suites, not for users' jobs."""
    return "testing" in target.partition(":")[0].split(".")


def _import_target(target: str) -> Any:
    module_name, _, attribute = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        obj = getattr(obj, part)
    return obj


class Registry:
    """The plugins of one entry-point group, e.g. ``Registry("drivetrain.engines", "engine")``."""

    def __init__(self, group: str, kind: str, base: type | None = None) -> None:
        self.group = group
        self.kind = kind  # singular noun for messages: "engine", "rollout", ...
        self.base = base
        self._records: dict[str, PluginRecord] | None = None
        self._hidden: set[str] = set()  # test doubles left out (DRIVETRAIN_TEST_PLUGINS unset)
        self._loaded: dict[str, Any] = {}

    @property
    def label(self) -> str:
        """The group's short name used in ``DRIVETRAIN_PLUGINS`` (``engines``...)."""
        return self.group.rpartition(".")[2]

    # ---- discovery (metadata only) ------------------------------------------------------
    def refresh(self) -> None:
        """Forget everything; the next call re-reads entry points and the environment."""
        self._records = None
        self._hidden.clear()
        self._loaded.clear()

    def _discover(self) -> dict[str, PluginRecord]:
        if self._records is not None:
            return self._records
        rules = os.environ.get(ENV_VAR)
        with_doubles = os.environ.get(TEST_PLUGINS_VAR) == "1"
        records: dict[str, PluginRecord] = {}
        seen: dict[str, list[str]] = {}
        for ep in metadata.entry_points(group=self.group):
            if is_test_double(ep.value) and not with_doubles:
                self._hidden.add(ep.name)
                continue
            dist = getattr(ep, "dist", None)
            dist_name = dist.metadata["Name"] if dist is not None else ""
            dist_version = dist.version if dist is not None else ""
            seen.setdefault(ep.name, []).append(f"{dist_name} {dist_version}".strip())
            if ep.name in records:
                continue
            record = PluginRecord(self.group, ep.name, ep.value, dist_name, dist_version)
            ok, why = _allowed(self.label, ep.name, rules)
            if not ok:
                record = replace(record, status=Status.DISABLED, reason=why)
            records[ep.name] = record
        for name, providers in seen.items():
            if len(set(providers)) > 1:
                reason = f"provided by several distributions: {', '.join(sorted(set(providers)))}"
                records[name] = replace(records[name], status=Status.CONFLICT, reason=reason)
        self._records = dict(sorted(records.items()))
        return self._records

    def names(self) -> list[str]:
        """Every discovered name, including disabled and broken ones."""
        return list(self._discover())

    # ---- checks and loading -------------------------------------------------------------
    def _set(self, record: PluginRecord, **changes: Any) -> PluginRecord:
        record = replace(record, **changes)
        self._discover()[record.name] = record
        return record

    def _check_spec(self, name: str) -> PluginRecord | None:
        """Import the spec module and check it; record (never raise) any problem."""
        record = self._discover().get(name)
        if record is None or record.spec is not None or record.status is not Status.DISCOVERED:
            return record
        try:
            spec = _import_target(record.target)
        except Exception as exc:
            return self._set(record, status=Status.FAILED, reason=f"{type(exc).__name__}: {exc}")
        if not isinstance(spec, PluginSpec):
            why = f"entry point {record.target} is a {type(spec).__name__}, not a PluginSpec"
            return self._set(record, status=Status.INVALID, reason=why)
        if spec.name != name:
            why = f"entry point {name!r} holds the spec of {spec.name!r}"
            return self._set(record, status=Status.INVALID, reason=why, spec=spec)
        if not VersionRange.parse(spec.api).contains(API_VERSION):
            why = (
                f"implements engine-api {spec.api}, but drivetrain-engine-api {API_VERSION} is "
                f"installed (pip install 'drivetrain-engine-api{spec.api}' or upgrade the plugin)"
            )
            return self._set(record, status=Status.INCOMPATIBLE, reason=why, spec=spec)
        return self._set(record, spec=spec)

    def _resolve(self, name: str) -> PluginRecord | None:
        """Check the spec, then import the factory; record (never raise) any problem."""
        record = self._check_spec(name)
        if record is None or record.status is not Status.DISCOVERED:
            return record
        assert record.spec is not None
        try:
            factory = _import_target(record.spec.factory)
        except Exception as exc:
            return self._set(record, status=Status.FAILED, reason=f"{type(exc).__name__}: {exc}")
        if self.base is not None and not (
            isinstance(factory, type) and issubclass(factory, self.base)
        ):
            base = f"{self.base.__module__}.{self.base.__name__}"
            why = f"{record.spec.factory} is not a subclass of {base}"
            return self._set(record, status=Status.INVALID, reason=why)
        self._loaded[name] = factory
        return self._set(record, status=Status.OK)

    def _usable(
        self, record: PluginRecord | None, name: str, *, ok: tuple[Status, ...]
    ) -> PluginSpec:
        if record is None:
            raise PluginError(f"unknown {self.kind} {name!r}: {self._find_hint(name)}")
        if record.status not in ok:
            verb = "is installed but" if record.status is Status.FAILED else "cannot be used:"
            raise PluginError(
                f"{self.kind} {name!r} ({record.distribution} {record.version}) {verb} "
                f"{record.describe()}; {self._others(exclude=name)}"
            )
        assert record.spec is not None
        return record.spec

    def spec(self, name: str) -> PluginSpec:
        """The plugin's declaration (imports only its spec module); raises if unusable."""
        return self._usable(self._check_spec(name), name, ok=(Status.DISCOVERED, Status.OK))

    def load(self, name: str, *, require: Iterable[str] = ()) -> Any:
        """Import and return the plugin's factory (its class), checking ``require``d
        capabilities. Cached: later calls return the same object."""
        spec = self._usable(self._resolve(name), name, ok=(Status.OK,))
        missing = sorted(set(require) - spec.capabilities)
        if missing:
            raise PluginError(
                f"{self.kind} {name!r} lacks capabilities {missing}; it declares "
                f"{sorted(spec.capabilities)}. Plugins with them: "
                f"{self._with_capabilities(set(require)) or 'none installed'}"
            )
        return self._loaded[name]

    def load_config_class(self, name: str, default: type) -> type:
        """The plugin's config dataclass (``default`` if it declares none)."""
        return self._declared(name, "config") or default

    def load_planner(self, name: str) -> Any | None:
        """The plugin's planner function (``drivetrain.api.plan``), or None if it has none."""
        return self._declared(name, "planner")

    def _declared(self, name: str, label: str) -> Any | None:
        """What the spec's ``label`` field names ("module:attribute"), imported; None if empty."""
        target = getattr(self.spec(name), label)
        if not target:
            return None
        try:
            return _import_target(target)
        except Exception as exc:
            raise PluginError(
                f"{self.kind} {name!r}: {label} {target} failed to import: {exc}"
            ) from exc

    def inspect(self, *, load: bool = True) -> list[PluginRecord]:
        """A record per discovered plugin; with ``load`` each is imported to report its status."""
        for name in self.names():
            self._resolve(name) if load else self._check_spec(name)
        return list(self._discover().values())

    # ---- messages -----------------------------------------------------------------------
    def _with_capabilities(self, wanted: set[str]) -> str:
        self.inspect(load=False)
        return ", ".join(
            r.name for r in self._discover().values() if r.spec and wanted <= r.spec.capabilities
        )

    def _others(self, *, exclude: str = "") -> str:
        """The installed names (from metadata: nothing is imported to say it)."""
        names = [n for n in self.names() if n != exclude]
        other = "other " if exclude else ""
        if not names:
            return f"no {other}{self.kind}s are installed (entry-point group {self.group})"
        return (
            f"{other}installed {self.kind}s: {', '.join(names)} "
            f"(`drivetrain {self.kind}s` shows their status)"
        )

    def _find_hint(self, name: str) -> str:
        """How to get ``name``: the install command of drivetrain's own plugins, else where
        third-party ones register and what is installed."""
        if name in self._hidden:
            return f"a test double, found only with {TEST_PLUGINS_VAR}=1; {self._others()}"
        install = INSTALL_HINTS.get(self.group, {}).get(name)
        if install:
            return f"install it with {install}; {self._others()}"
        close = difflib.get_close_matches(name, self.names(), n=1)
        guess = f"did you mean {close[0]!r}? " if close else ""
        return (
            f"{guess}{self._others()}; a third-party {self.kind} is found once the "
            f"distribution that declares it in entry-point group {self.group} is installed"
        )


engines = Registry("drivetrain.engines", "engine", Engine)
rollouts = Registry("drivetrain.rollouts", "rollout", Rollout)
ckpt_engines = Registry("drivetrain.ckpt_engines", "ckpt-engine", WeightTransport)
environments = Registry("drivetrain.environments", "environment", Environment)
REGISTRIES = {r.label: r for r in (engines, rollouts, ckpt_engines, environments)}


def refresh_all() -> None:
    """Forget every registry's cache (after installing plugins or changing the env var)."""
    for registry in REGISTRIES.values():
        registry.refresh()
