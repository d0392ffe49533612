"""CI gate: no tracked Python or shell file passes 500 lines unless `.ci/long_files.txt`
names it with its reason (one ``path  # reason`` per line). An allowed file that has come
back under the limit must leave the list too, so the list stays true."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

LIMIT = 500
ROOT = Path(__file__).resolve().parents[1]
ALLOWED = ROOT / ".ci" / "long_files.txt"


def allowed() -> dict[str, str]:
    """path -> reason, from the allow-list (a line without a reason is an error)."""
    found = {}
    for number, line in enumerate(ALLOWED.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        path, _, reason = line.partition("#")
        if not reason.strip():
            sys.exit(f"{ALLOWED.name}:{number}: {path.strip()} has no reason")
        found[path.strip()] = reason.strip()
    return found


def main() -> int:
    tracked = subprocess.run(
        ["git", "ls-files", "*.py", "*.sh"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    allow = allowed()
    problems = []
    for path in tracked:
        lines = len((ROOT / path).read_text().splitlines())
        if lines > LIMIT and path not in allow:
            problems.append(
                f"{path}: {lines} lines (limit {LIMIT}; split it, or allow it with a reason "
                "in .ci/long_files.txt)"
            )
        elif lines <= LIMIT and path in allow:
            problems.append(
                f"{path}: {lines} lines, under the limit: take it off .ci/long_files.txt"
            )
    problems += [f"{path}: allowed but not tracked" for path in allow if path not in tracked]
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
