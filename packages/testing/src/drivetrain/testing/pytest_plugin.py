"""A pytest plugin (registered by drivetrain-testing: installing it is the opt-in): test
sessions see the test doubles.

The ``fake`` engine, rollout and transport are hidden from users' jobs and listings unless
``DRIVETRAIN_TEST_PLUGINS=1``. Setting it in this process's environment, before any test
runs, reaches what the tests start too: ``drivetrain`` subprocesses, torchrun ranks, rollout
server processes and Ray workers inherit it.
"""

from __future__ import annotations

import os

from drivetrain.api.registry import TEST_PLUGINS_VAR


def pytest_configure(config: object) -> None:
    os.environ.setdefault(TEST_PLUGINS_VAR, "1")
