"""How long the plugin CLI takes: ``drivetrain engines`` (entry-point metadata and the light
spec modules) vs ``drivetrain engines --check`` (imports every engine plugin, which is what the
plain listing did before), side by side, interleaved (``timing.py``: one warm-up round, at
least 5 timed rounds, one ratio per round); and ``drivetrain grpo --print-config`` on an empty
``DRIVETRAIN_CACHE`` each round (it names the built-in SFT model it would train, training
nothing). Each is a fresh process, as a user runs it.

The last line is JSON: ``listing_speedup_vs_import_all`` (median, spread), and the median
seconds of the listing and of ``--print-config``.
Usage: uv run python benchmarks/cli.py [--pairs N] [--quick]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from statistics import median

from timing import add_arguments, interleaved, print_result, rounds_of, speedup

DRIVETRAIN = [sys.executable, "-m", "drivetrain.trainer"]


def run(*args: str, env: dict[str, str] | None = None) -> None:
    subprocess.run([*DRIVETRAIN, *args], check=True, capture_output=True, timeout=300, env=env)


def print_config() -> None:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "DRIVETRAIN_CACHE": cache}
        run("grpo", "--print-config", env=env)
        assert not os.listdir(cache), "--print-config wrote into the cache"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    args = parser.parse_args()
    times = interleaved(
        {
            "listing": lambda: run("engines"),
            "import_all": lambda: run("engines", "--check"),
            "print_config": print_config,
        },
        rounds_of(args),
    )
    for name, seconds in times.items():
        print(f"{name}: median {median(seconds):.2f} s over {len(seconds)} rounds", flush=True)
    print_result(
        {"listing_speedup_vs_import_all": speedup(times, "listing", "import_all")},
        listing_seconds=round(median(times["listing"]), 2),
        import_all_seconds=round(median(times["import_all"]), 2),
        print_config_seconds=round(median(times["print_config"]), 2),
    )


if __name__ == "__main__":
    main()
