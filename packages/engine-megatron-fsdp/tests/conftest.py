import os
import sys
from pathlib import Path

# our workers and helpers, and engine-megatron's (launcher, tiny models, harness, data); the
# launcher's worker processes find ours through PYTHONPATH
HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "engine-megatron" / "tests"))
os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
