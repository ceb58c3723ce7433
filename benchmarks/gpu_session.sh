#!/usr/bin/env bash
# Every GPU figure of issue 24 in one run on a bare GPU box (torch, transformers, pyarrow; no
# spaCy, Ray, DuckDB or FastAPI), from the checkout with PYTHONPATH=src:
#   here:  .venv/bin/python benchmarks/gpu_fixture.py prepare .dev     (~8 MB: ids + tokenizer)
#   there: OUT=/some/dir bash benchmarks/gpu_session.sh              (carry .dev)
# Sized for a lent machine's 15 minutes in two calls of at most 600 s (benchmarks/GPU.md has each part's time), in order of priority,
# each part under its own time limit: bench_stats_gpu.py (the fused kernels against the portable
# path: equal states, kernel times, a profile), `ffkv mine` end to end over 20M tokens as a user
# runs it (its first batches time packed rows and the fused kernels, FFKV_PACK/FFKV_TRITON=auto;
# mine_manifest.json's `tuning` holds each arm's throughput), bench_gpu.py on the SmolLM2-135M
# shape (every arm, fused and packed included), bench_forward_gpu.py (where a faster forward could
# come from: packed rows, Liger's kernels), the forward probe's torch.compile arm, mining through
# compiled blocks (FFKV_COMPILE) beside the best of the rest, then bench_gpu.py on the 1B and 8B
# Llama shapes. EXTRA=1 adds `ffkv explain` and `ffkv reproduce` on CUDA. mine_eager is the
# end-to-end run with `--compile 0` (the default on CUDA compiles after 20 s of mining); mutate is
# `ffkv mutate` on mine's run (the re-scoring engine on CUDA: its manifest holds the passes' figures);
# explore is bench_explore.py (serve's explorer: explain, with an intervention) on the fixture's model; mine_inline is the
# end-to-end run again with the corpus stream inline (--prefetch 0), against the default prefetch
# thread; host is bench_host.py --overlap (the stream beside a stand-in device, on this box's CPU);
# ray_driver is bench_host.py --ray-driver (a --ray pass's driver before its actors start: the plan
# from the ids' offsets against streaming the whole table; no Ray needed, so it runs on the bare box).
# QUICK=1 DEV=cpu shrinks every size and leaves the 8B shape out (a CPU dry run: 32 GB in float32).
# PARTS="stats mine smol 1b 8b" runs only the parts named (stats host ray_driver mine mutate explore mine_eager mine_inline mine_compiled smol forward
# compiled compiled_mine 1b stats1b 8b extra), in the order above; stats1b is the stats part on the
# 1B shape (where its 16,384 keys an update spend the time that keeps it under 120k tok/s); WORKERS=0,4 (the default) also times host preparation;
# MINE_TOKENS sets the end-to-end runs' size (mine_compiled: --compile auto, the tuner's compiled twin).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
PY=${PY:-python3}
W=${W:-/tmp/gpu_work}; rm -rf "$W"; mkdir -p "$W"
DEV=${DEV:-cuda}
IDS=.dev/wt2_train_ids.parquet
if [ "${QUICK:-0}" = 1 ]; then S1=20000 S8=2000 S1B=4000 SF=6000 MINE=100000 LAYERS=2 T=200; else
  S1=1500000 S8=100000 S1B=500000 SF=1000000 MINE=${MINE_TOKENS:-20000000} LAYERS=30 T=1; fi
ML=$((150 + MINE / 500000))  # the end-to-end runs' limit: 190 s at 20M tokens, 350 s at 100M
PARTS=${PARTS:-stats host ray_driver mine mutate explore mine_eager mine_inline mine_compiled smol forward compiled compiled_mine 1b stats1b 8b}; [ "${EXTRA:-0}" = 1 ] && PARTS="$PARTS extra"
want() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
part() { local secs=$1; shift; echo; echo "=== $* (limit ${secs}s) $(date +%T)"; local t0=$(date +%s.%N)
  timeout -k 5 "$((secs * T))" "$@"; local rc=$?
  echo "=== rc=$rc in $(echo "$(date +%s.%N) - $t0" | bc 2>/dev/null || $PY -c "import time;print(round(time.time()-$t0,1))") s"; }
{
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.sm --format=csv 2>&1 | head -3
$PY -c "import torch, transformers, pyarrow; print('torch', torch.__version__, 'transformers', transformers.__version__, 'pyarrow', pyarrow.__version__, 'cuda', torch.cuda.is_available(), 'cores', __import__('os').cpu_count())"
want stats && part 120 $PY benchmarks/bench_stats_gpu.py --corpus $IDS --tokens $S8
want host && part 60 $PY benchmarks/bench_host.py --corpus $IDS --tokenizer .dev/tok --overlap 368000 --runs 2
want ray_driver && part 60 $PY benchmarks/bench_host.py --corpus $IDS --tokenizer .dev/tok --ray-driver --runs 3
{ want mine || want mine_eager || want mine_inline || want mine_compiled || want explore; } && part 40 $PY benchmarks/gpu_fixture.py build .dev "$W" --tokens $MINE --layers $LAYERS
want mine && part $ML $PY -m ffkv.cli mine --model "$W/model" --corpus "$W/stream.u16" --out "$W/run" --device $DEV --json
want mine && cp "$W/run/manifest.json" "$OUT/mine_manifest.json" 2>/dev/null
want mutate && part 120 $PY -m ffkv.cli mutate "$W/run" --device $DEV --json
want mutate && cp "$W/run/manifest.json" "$OUT/mutate_manifest.json" 2>/dev/null
want explore && part 90 $PY benchmarks/bench_explore.py --model "$W/model" --device $DEV --corpus $IDS --repeats 5
want mine_eager && part $ML $PY -m ffkv.cli mine --model "$W/model" --corpus "$W/stream.u16" --out "$W/run_e" --device $DEV --compile 0 --json
want mine_eager && cp "$W/run_e/manifest.json" "$OUT/mine_eager_manifest.json" 2>/dev/null
want mine_inline && part $ML $PY -m ffkv.cli mine --model "$W/model" --corpus "$W/stream.u16" --out "$W/run_i" --device $DEV --prefetch 0 --json
want mine_inline && cp "$W/run_i/manifest.json" "$OUT/mine_inline_manifest.json" 2>/dev/null
want mine_compiled && part $ML $PY -m ffkv.cli mine --model "$W/model" --corpus "$W/stream.u16" --out "$W/run_c" --device $DEV --compile auto --json
want mine_compiled && cp "$W/run_c/manifest.json" "$OUT/mine_compiled_manifest.json" 2>/dev/null
want smol && part 130 $PY benchmarks/bench_gpu.py --shape smollm2-135m --corpus $IDS --tokenizer .dev/tok --tokens $S1 --workers ${WORKERS:-0,4} --host-tokens 300000 --pack 256
want forward && part 60 $PY benchmarks/bench_forward_gpu.py --corpus $IDS --tokens $SF --arms packed,liger --liger .dev/liger
want compiled && part 120 $PY benchmarks/bench_forward_gpu.py --corpus $IDS --tokens $SF --arms compiled
want compiled_mine && part 120 $PY benchmarks/bench_gpu.py --shape smollm2-135m --corpus $IDS --tokens $SF --workers 0 --host-tokens 1000 --pack 256 --compile --arms ${COMPILED_ARMS:-stats,stats_fused,stats_fused_packed,stats_compiled,stats_fused_compiled,stats_fused_packed_compiled}
want 1b && part 100 $PY benchmarks/bench_gpu.py --shape llama-1b --corpus $IDS --tokens $S1B --workers 0 --host-tokens 100000 --compile
want stats1b && part 100 $PY benchmarks/bench_stats_gpu.py --shape llama-1b --corpus $IDS --tokens $S8
[ "${QUICK:-0}" = 1 ] || { want 8b && part 130 $PY benchmarks/bench_gpu.py --shape llama-8b --corpus $IDS --tokens $S8 --workers 0 --host-tokens 100000 --compile; }
if want extra; then
part 30 $PY -m ffkv.cli explain "The capital of France is" --model "$W/model" --device $DEV --top 2 --json
part 240 $PY -m ffkv.cli reproduce "$W/rep" --model "$W/model" --corpus "$W/stream.u16" --compose-corpus "$W/held.u16" --device $DEV --no-semantic
fi
} 2>&1 | grep --line-buffered -v "profiler_st" | tee "$OUT/gpu_session.log"
cp "$W/rep/manifest.json" "$OUT/rep_manifest.json" 2>/dev/null
true
