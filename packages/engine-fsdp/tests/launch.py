"""Run a worker script on N ranks with torchrun and collect each rank's JSON result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent


def torchrun(
    script: str, out_dir: Path, *args: str, nproc: int = 2, timeout: float = 600
) -> list[Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        str(HERE / script), str(out_dir), *args,
    ]  # fmt: skip
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(
            f"{script} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)]


def write_result(out_dir: str, value: Any) -> None:
    rank = int(os.environ.get("RANK", 0))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(value))
