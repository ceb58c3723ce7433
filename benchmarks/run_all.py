"""Run every benchmark in turn (`make bench`). Each prints its own ratios; run them on a quiet machine."""
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for script in ("bench_mine.py", "bench_values.py", "bench_compose.py", "bench_mutate.py"):
    print(f"\n=== {script}", flush=True)
    r = subprocess.run([sys.executable, str(HERE / script), *sys.argv[1:]], cwd=HERE)
    if r.returncode != 0:
        print(f"{script} failed with exit code {r.returncode}", flush=True)
