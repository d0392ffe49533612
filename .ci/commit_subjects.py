"""CI gate: every commit since the rule began has a subject of at most 72 characters (the
detail goes in the body), and no ``# fmt: skip`` count in product code past its budget (the
formatter decides layout; a skip is for a table that reads better aligned)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUBJECT_LIMIT = 72
#: the last commit before the rule; older subjects are history, not checked
SINCE = "d50c11ba15a6a9051604074062cdaad4bf796692"
FMT_SKIP_BUDGET = 75


def git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout


def long_subjects() -> list[str]:
    known = subprocess.run(
        ["git", "cat-file", "-e", f"{SINCE}^{{commit}}"], cwd=ROOT, capture_output=True
    )
    span = f"{SINCE}..HEAD" if known.returncode == 0 else "-1"  # a shallow clone: HEAD only
    lines = git("log", "--format=%h %s", span).splitlines()
    return [line for line in lines if len(line.split(" ", 1)[1]) > SUBJECT_LIMIT]


def fmt_skips() -> int:
    files = git("ls-files", "packages/*/src/*.py").splitlines()
    return sum((ROOT / f).read_text().count("# fmt: skip") for f in files)


def main() -> int:
    failed = False
    for line in long_subjects():
        print(f"commit subject over {SUBJECT_LIMIT} characters: {line}", file=sys.stderr)
        failed = True
    skips = fmt_skips()
    if skips > FMT_SKIP_BUDGET:
        print(f"{skips} '# fmt: skip' in packages/*/src, budget {FMT_SKIP_BUDGET}", file=sys.stderr)
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
