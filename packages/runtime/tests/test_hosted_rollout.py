"""The trainer's side of a rollout in another environment: a config type from the fields that
environment describes, and one-line refusals for what cannot be described or built."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from drivetrain.api import PluginError, PluginSpec
from drivetrain.api.hosting import HostingConfig
from drivetrain.runtime.hosted_rollout import HostedRollout, describe_in

SPEC = PluginSpec(name="acme_gen", factory="acme.rollout:Acme", api=">=0.1,<0.2")


def hosted(*fields: dict) -> HostedRollout:
    return HostedRollout(
        python="/envs/acme/bin/python",
        spec=SPEC,
        distribution="acme-rollout",
        version="1.0",
        config_target="acme.config:AcmeConfig",  # not installed here
        fields=fields,
        transports={"colocated": ""},
    )


def test_a_config_type_from_described_fields():
    config_class = hosted(
        {"name": "stall_timeout_s", "type": "float", "default": 30.0},  # its own default wins
        {"name": "beam", "type": "int", "default": 4},
        {"name": "stops", "type": "tuple[str]", "default": ["\n"]},
    ).config_class()
    assert config_class.__name__ == "HostedAcmeGenConfig"
    assert issubclass(config_class, HostingConfig)
    config = config_class(beam=2, python="/envs/acme/bin/python")
    assert (config.beam, config.stops, config.stall_timeout_s) == (2, ("\n",), 30.0)
    names = [f.name for f in dataclasses.fields(config)]
    assert names[-2:] == ["beam", "stops"] and "start_timeout_s" in names


@pytest.mark.parametrize(
    ("field", "named"),
    [
        ({"name": "lora", "type": "LoraConfig", "supported": False, "default": "x"}, "lora ("),
        ({"name": "beam", "type": "int", "required": True}, "beam (int, no default)"),
        ({"name": "env", "type": "str", "default": ""}, "the hosting knob rollout.env is not"),
    ],
)
def test_fields_that_cannot_be_built_here_are_refused_in_one_line(field, named):
    with pytest.raises(PluginError) as refused:
        hosted(field).config_class()
    message = str(refused.value)
    assert message.startswith("rollout 'acme_gen' in rollout.python=/envs/acme/bin/python")
    assert named in message and "install acme-rollout here too" in message
    assert "\n" not in message


def test_a_transport_it_lacks_is_named():
    assert hosted().transport_problem("colocated") == ""
    assert "ckpt-engine 'disk' is not installed there" in hosted().transport_problem("disk")


def test_what_describes_nothing_is_refused_in_one_line(tmp_path):
    with pytest.raises(PluginError, match="is not an executable interpreter; make one with"):
        describe_in(str(tmp_path / "python"), "acme")
    bare = tmp_path / "bare"  # an interpreter without drivetrain
    bare.write_text("#!/bin/sh\necho 'No module named drivetrain' >&2\nexit 1\n")
    bare.chmod(0o755)
    with pytest.raises(
        PluginError, match=r"No module named drivetrain\); its environment needs drivetrain-runtime"
    ):
        describe_in(str(bare), "acme")
    with pytest.raises(PluginError, match="rollout 'acme' is not installed in the environment of"):
        describe_in(sys.executable, "acme")
