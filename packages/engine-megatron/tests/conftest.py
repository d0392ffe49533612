import sys
from pathlib import Path

# helpers (megatron_launch) and worker scripts live next to the tests
sys.path.insert(0, str(Path(__file__).parent))
