"""The transport kit's harness for the built-in transports: torch tensors from
``weights_for_tests``, buckets of 4 KiB, verification on, on the CPU."""

from __future__ import annotations

from pathlib import Path

import torch

from drivetrain.api.config import WeightSyncConfig
from drivetrain.api.registry import ckpt_engines
from drivetrain.ckpt.buckets import digest_of
from drivetrain.testing.transport_kit import TransportHarness
from weights_for_tests import make_weights

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.int64: "int64",
           torch.bool: "bool", torch.float16: "float16"}  # fmt: skip


class BuiltinHarness(TransportHarness):
    name = ""
    sys_path = (str(Path(__file__).parent),)

    def make_transport(self, **overrides):
        config_class = ckpt_engines.load_config_class(self.name, WeightSyncConfig)
        config = {"bucket_bytes": 4096, "timeout_s": 20.0, "verify": True, "device": "cpu"}
        return ckpt_engines.load(self.name)(config_class(**{**config, **overrides}))

    def weights(self, version):
        return make_weights(version)

    def digest(self, weights):
        return digest_of(list(weights))

    def copy(self, tensor):
        return tensor.clone()

    def spec_of(self, tensor):
        return tuple(tensor.shape), _DTYPES[tensor.dtype]


class BroadcastHarness(BuiltinHarness):
    name = "broadcast"


class ColocatedHarness(BuiltinHarness):
    name = "colocated"


class DiskHarness(BuiltinHarness):
    name = "disk"

    def make_transport(self, **overrides):
        # a dead reader's heartbeat is noticed after liveness_s (10 s by default)
        return super().make_transport(**{"liveness_s": 3.0, **overrides})
