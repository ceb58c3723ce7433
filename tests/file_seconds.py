"""Refresh `file_seconds.json`, the worker seconds each test file took, from a suite log.

    .venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=0 > suite.log   # a whole run
    .venv/bin/python tests/file_seconds.py suite.log

conftest hands files to the workers longest first from this table (LPT scheduling), so that the
last file a worker starts is a short one and both workers end together. Only the order depends
on it: a stale table costs time, never a result."""
from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

TABLE = Path(__file__).with_name("file_seconds.json")
LINE = re.compile(r"^\s*([0-9.]+)s\s+(?:call|setup|teardown)\s+(?:tests/)?([\w/]+)\.py::")


def per_file(lines) -> dict[str, float]:
    """Seconds per test file stem, summed over its tests' setup, call and teardown."""
    out: dict[str, float] = defaultdict(float)
    for line in lines:
        m = LINE.match(line)
        if m:
            out[Path(m.group(2)).name] += float(m.group(1))
    return dict(out)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: file_seconds.py SUITE_LOG (a pytest run with --durations=0)", file=sys.stderr)
        return 2
    got = per_file(Path(argv[0]).read_text(errors="replace").splitlines())
    if not got:
        print(f"{argv[0]}: no --durations=0 lines in it", file=sys.stderr)
        return 2
    TABLE.write_text(json.dumps({k: round(v, 1) for k, v in sorted(got.items(), key=lambda kv: -kv[1])}, indent=0)
                     + "\n")
    print(f"{TABLE}: {len(got)} files, {sum(got.values()):.0f} worker seconds")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
