"""Run every benchmark in turn (`make bench`). Each prints its own ratios; run them on a quiet machine.

`make bench RUN=runs/default` also times the browser and values on that run; without a finished
run those two are skipped with a note. bench_gpu says why it skipped when there is no CUDA.
"""
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
run = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--run=")), None)
NEEDS_RUN = {"bench_values.py", "bench_serve.py"}
for script in ("bench_mine.py", "bench_values.py", "bench_compose.py", "bench_mutate.py", "bench_explore.py",
               "bench_normalize.py", "bench_serve.py", "bench_rank.py", "bench_gpu.py", "bench_gguf_refusal.py",
               "bench_census.py"):
    print(f"\n=== {script}", flush=True)
    if script in NEEDS_RUN and not run:
        print(f"skipped: {script} needs a finished run (make bench RUN=runs/default)", flush=True)
        continue
    r = subprocess.run([sys.executable, str(HERE / script), *(["--run", run] if script in NEEDS_RUN else [])], cwd=HERE)
    if r.returncode != 0:
        print(f"{script} failed with exit code {r.returncode}", flush=True)
