"""The trainer's side of a rollout hosted in another Python environment (``rollout.python``;
the knobs are :class:`drivetrain.api.hosting.HostingConfig`)::

    trainer                                        rollout.python's environment
    ───────                                        ────────────────────────────
    describe_in ─── python -m drivetrain.runtime.describe rollout NAME ──▶ its registry
    rollout_host()(NAME, config) ── the host's proxy ───────────▶ the rollout, built there

:func:`describe_in` asks that environment's interpreter for the rollout
(:mod:`drivetrain.runtime.describe`) and returns a :class:`HostedRollout`: its spec as
installed there, its config fields, and which weight-sync transports it could receive over.
:meth:`HostedRollout.config_class` is the type of ``rollout.*`` in the job: the rollout's own
config class where this environment has the same one (its checks and nested sections kept),
else a :class:`~drivetrain.api.hosting.HostingConfig` subclass built from the described fields,
so ``rollout.<field>=`` overrides work for a rollout installed only there. Its values reach the
host as plain fields, rebuilt into the rollout's class on the far side.

:func:`rollout_host` is what runs it there: the entry point ``process`` of the group
``drivetrain.rollout_hosts`` (drivetrain-rollout registers its server process), called as
``host(name, config) -> Rollout``; the trainer reaches it, like every backend, through an entry
point and never by import.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from drivetrain.api.errors import PluginError
from drivetrain.api.hosting import HostingConfig
from drivetrain.api.plugin import PluginSpec
from drivetrain.api.registry import rollouts

_SCALARS: dict[str, type] = {t.__name__: t for t in (str, int, float, bool)}
#: how to make an environment for a rollout that is not a recipe of drivetrain's own
MAKE_ENV = "python -m drivetrain.rollout.env --package <its distribution> hf <dir>"
DESCRIBE = "drivetrain.runtime.describe"
#: the entry-point group of rollout hosts (``host(name, config) -> Rollout``)
HOSTS_GROUP = "drivetrain.rollout_hosts"
#: variables that would make another interpreter load this environment's packages
ISOLATE = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")


def child_env(extra: Sequence[str] = ()) -> dict[str, str]:
    """This process's environment for another interpreter: without what would make it load
    this environment's packages, plus ``extra`` ``NAME=value`` items (``rollout.env``)."""
    env = {k: v for k, v in os.environ.items() if k not in ISOLATE}
    env.update(item.split("=", 1) for item in extra)
    return env


def rollout_host(name: str = "process") -> Callable[[str, Any], Any]:
    """The host ``name`` of :data:`HOSTS_GROUP`: ``host(rollout_name, config)`` runs that
    rollout where ``config.python`` says and returns its proxy."""
    hint = "pip install drivetrain-rollout (it registers the server-process host)"
    found = [ep for ep in metadata.entry_points(group=HOSTS_GROUP) if ep.name == name]
    if not found:
        raise PluginError(
            f"rollout.python needs the rollout host {name!r} (entry-point group {HOSTS_GROUP}) "
            f"in this environment: {hint}"
        )
    try:
        return found[0].load()
    except Exception as exc:
        raise PluginError(
            f"rollout host {name!r} ({found[0].value}) failed to import: "
            f"{type(exc).__name__}: {exc} ({hint})"
        ) from exc


def _python_type(name: str) -> Any:
    """The type a described field has here (``None``: one not built across environments)."""
    if name in _SCALARS:
        return _SCALARS[name]
    inner = name.removeprefix("tuple[").removesuffix("]")
    if name.startswith("tuple[") and inner in _SCALARS:
        return tuple[_SCALARS[inner], ...]  # type: ignore[valid-type]
    return None


@dataclass(frozen=True)
class HostedRollout:
    """A rollout as the environment of ``python`` has it installed."""

    python: str
    spec: PluginSpec
    distribution: str
    version: str
    config_target: str  # its config class, "module:attribute"
    fields: tuple[Mapping[str, Any], ...]  # as python -m drivetrain.runtime.describe says
    transports: Mapping[str, str]  # transport -> "" (usable there) or why it is not

    @property
    def where(self) -> str:
        return _where(self.python)

    def transport_problem(self, transport: str) -> str:
        """Why weights cannot reach the rollout over ``transport`` there (``""``: they can)."""
        if transport in self.transports:
            return self.transports[transport]
        return f"ckpt-engine {transport!r} is not installed there"

    def config_class(self) -> type[HostingConfig]:
        """The type of ``rollout.*``: the rollout's own class when this environment has the
        same (extended with the hosting knobs where it lacks them), else one built from the
        described fields; a field that cannot be built here is refused in one line."""
        local = self._local_class()
        if local is not None:
            if issubclass(local, HostingConfig):
                return local
            return dataclasses.make_dataclass(
                local.__name__, [], bases=(local, HostingConfig), frozen=True
            )
        return self._built_class()

    def _local_class(self) -> type | None:
        try:
            if rollouts.spec(self.spec.name).config != self.config_target:
                return None
            return rollouts.load_config_class(self.spec.name, object)
        except PluginError:  # not here, or broken here: the described fields are the truth
            return None

    def _built_class(self) -> type[HostingConfig]:
        hints = typing.get_type_hints(HostingConfig)
        fields, refused = [], []
        for item in self.fields:
            name, kind = item["name"], _python_type(item["type"])
            if kind is None or item.get("required"):
                refused.append(f"{name} ({item['type']}{', no default' * bool(kind)})")
            elif name in hints and hints[name] != kind:
                refused.append(f"{name} ({item['type']}, the hosting knob rollout.{name} is not)")
            else:
                default = item["default"]  # JSON: a tuple's default came as a list
                default = tuple(default) if isinstance(default, list) else default
                fields.append((name, kind, dataclasses.field(default=default)))
        if refused:
            raise PluginError(
                f"rollout {self.spec.name!r} in {self.where} has config fields this environment "
                f"cannot set: {', '.join(refused)} (across environments: str, int, float, bool "
                f"and tuples of them, with defaults); install {self.distribution} here too, so "
                "that its own config class is used"
            )
        title = "".join(part.capitalize() for part in self.spec.name.replace("-", "_").split("_"))
        doc = (
            f"rollout {self.spec.name!r} ({self.distribution} {self.version}) hosted by "
            f"{self.python}: its config fields as described there, and the hosting knobs"
        )
        return dataclasses.make_dataclass(
            f"Hosted{title}Config",
            fields,
            bases=(HostingConfig,),
            frozen=True,
            namespace={"__doc__": doc, "__module__": __name__},
        )


def _where(python: str) -> str:
    """How every message names the environment: by the key that chose it."""
    return f"rollout.python={python}"


def describe_in(
    python: str, name: str, *, env: Sequence[str] = (), timeout_s: float = 120.0
) -> HostedRollout:
    """The rollout ``name`` as the interpreter ``python`` has it installed, or a one-line
    :class:`PluginError` saying what is missing there and how to install it (``env``:
    ``rollout.env``, e.g. a ``DRIVETRAIN_PLUGINS`` for that environment)."""
    where = _where(python)
    exe = Path(python).expanduser()
    if not exe.is_file() or not os.access(exe, os.X_OK):
        raise PluginError(f"{where} is not an executable interpreter; make one with: {MAKE_ENV}")
    try:
        done = subprocess.run(
            [str(exe), "-m", DESCRIBE, "rollout", name],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=child_env(env),
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise PluginError(f"{where} did not describe rollout {name!r} in {timeout_s:g} s") from None
    lines = done.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1])
    except (IndexError, ValueError):  # no drivetrain-engine-api there, or it crashed
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise PluginError(
            f"{where} cannot describe rollout {name!r} ({last}); its environment needs "
            f"drivetrain-runtime, at this one's version, and the rollout: {MAKE_ENV}"
        ) from None
    if "error" in answer:
        raise PluginError(_refusal(name, python, answer))
    spec = PluginSpec(
        name=answer["name"],
        factory=answer["factory"],  # importable there, never here
        api=answer["api"],
        capabilities=frozenset(answer["capabilities"]),
        install_hint=answer["install_hint"],
        description=answer["description"],
    )
    return HostedRollout(
        python=python,
        spec=spec,
        distribution=answer["distribution"],
        version=answer["version"],
        config_target=answer["config"],
        fields=tuple(answer["fields"]),
        transports=answer["transports"],
    )


def _refusal(name: str, python: str, answer: Mapping[str, Any]) -> str:
    """One line: the rollout missing in that environment (and how to install it there), or
    its registry's own reason it cannot be used there."""
    where = _where(python)
    if answer.get("installed", True):
        return f"rollout {name!r} cannot be used in the environment of {where}: {answer['error']}"
    try:  # installed here too: its own hint names the distribution
        hint = rollouts.spec(name).install_hint
    except PluginError:
        hint = ""
    names = ", ".join(answer.get("names", ())) or "none"
    return (
        f"rollout {name!r} is not installed in the environment of {where} (its rollouts: "
        f"{names}); install it there: uv pip install --python {python} <its distribution>"
        f"{f' ({name!r} says: {hint})' if hint else ''}, or make one with: {MAKE_ENV}"
    )
