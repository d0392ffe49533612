import sys
from pathlib import Path

# helpers (weights_for_tests) and the transport worker script live next to the tests
sys.path.insert(0, str(Path(__file__).parent))
