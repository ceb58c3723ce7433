"""The `mine` step as one unit: its settings (from which `ffkv mine` is generated), the command's
own options (--out, --overwrite, --lens) and how it opens its run, what the manifest records, its
place in `reproduce`, the command that rebuilds it, its summary and its report section
(`report.py`: key activations). Its pass (`compute.py`: batching, checkpoints, resume, tables;
`distributed.py`: Ray shards) runs the tracker engine and kernels of `ffkv.mine`; both are named
by "module:attr" and imported only when the step runs, so that `ffkv --help` loads no torch.

Tables: `sentences`, `triggers`, `vocab` always; `key_stats`, `key_hist`, `key_samples` unless
--no-stats (columns: DEVELOPING.md and `ffkv.mine.stats`); `key_covariance` with --covariance
(`ffkv.mine.covariance`); `sign_regimes` with --regimes (`ffkv.mine.regimes`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ffkv.defs import CORPUS_CONTEXT, LENS_HELP, LENSES
from ffkv.errors import FfkvError
from ffkv.parse import parse_int_list
from ffkv.steps import lazy
from ffkv.steps.lifecycle import Step
from ffkv.steps.settings import Flag, a_seed, at_least, between, budget, setting

DEFAULT_CORPUS = "wikipedia:train"


check_batch_tokens, _batch_tokens = budget(16)  # 'auto' or >= 16: below one short sentence is no budget


def _layers(text: str) -> list[int] | None:
    return parse_int_list(text, None, "layers")  # bounds: `fit` once the model is known


def _cov_layers(text: str) -> list[int] | None:
    return parse_int_list(text, None, "covariance")


def _dims(text: str) -> list[int] | None:
    return parse_int_list(text, None, "dims")


def _switch(module: str, name: str):
    """A --pack / --fused-kernels / --compile parser: the text its environment variable takes,
    checked by that variable's own parser (`ffkv.mine.packing.parse`, ...), kept as text."""
    def parse(text: str) -> str:
        import importlib

        v = importlib.import_module(module).parse(text, name)
        return "0" if v is None else str(v)
    return parse


@dataclass(frozen=True)
class MineSettings:
    """What `ffkv mine` is asked for. `batch_tokens`, `checkpoint_every`, `ray`, `shards`,
    `workers`, `prefetch`, `chunk_sentences`, `pack`, `fused_kernels` and `compile_blocks` change how the pass runs, not
    what it finds (tests hold mining to that): none is recorded."""
    corpus: str | None = setting(None, "Corpus source (see `ffkv corpus --help`). Default: the embedded Wikipedia's "
                                       "train split (compose holds out wikipedia:valid).", short="-c",
                                 shown=DEFAULT_CORPUS,
                                 reproduce=Flag(default=None, short="-c", help="Mining corpus (default wikipedia:train), "
                                                "e.g. wikitext-103:train or a file."))
    max_sentences: int | None = setting(None, "Cap on sentences (after a seeded shuffle of documents).",
                                        check=at_least(1),
                                        reproduce=Flag("--sentences", default=1500, presets={"full": None}, min=1,
                                                       help="Sentences to mine (default 1,500; the paper: all of "
                                                            "WikiText-103 train)."))
    seed: int = setting(0, "Seed of the document order.", check=a_seed)
    field: str = setting("text", "JSONL field holding the text (a Parquet corpus: the column of token ids).")
    context: int = setting(CORPUS_CONTEXT, "Window, in tokens, that a flat token stream (.u16, .u32, .bin:u16) is cut into.",
                           check=between(1, 1 << 20))
    layers: list[int] | None = setting(None, "Layers to mine, e.g. 0,5,10-12. Default: all.", parse=_layers)
    dims: list[int] | None = setting(None, "Memory dims to mine, e.g. 0-99. Default: all.", parse=_dims)
    top_k: int = setting(50, "Trigger examples kept per key.", check=between(1, 10000), short="-t",
                         reproduce=Flag(default=50, min=1, help="Trigger examples per key (default 50)."))
    negative: bool = setting(False, "Also keep the most negative coefficients (sign=-1).",
                             reproduce=Flag(default=None, help="Mine most-negative triggers too (default: when the "
                                                               "FFN is gated)."))
    per_prefix: bool = setting(False, "Allow several prefixes of one sentence per key.")
    batch_tokens: int | str = setting("auto", "Token budget per batch (length-packed; speed and memory only): auto "
                                              "(2,048 on a CPU; on CUDA sized from free memory and the model's shape) "
                                              "or a number >= 16.", check=_batch_tokens, parse=check_batch_tokens,
                                      recorded=False)
    stats: bool = setting(True, "Also keep every key's activation statistics (histogram, density, quantile "
                                "samples, positions) from the same pass.", flag="--stats/--no-stats")
    covariance: list[int] | None = setting(None, "Layers whose keys' second moment C = E[m mᵀ] over the mined "
                                                 "tokens is kept too (table key_covariance; the preconditioner of "
                                                 "`ffkv facts edit`), e.g. 8 or 6-10; 24·d_m² bytes of state a "
                                                 "layer. Needs every dim mined.", parse=_cov_layers)
    regimes: bool = setting(False, "Also sum each memory's activation mass Σ|m| and its tokens in the four sign "
                                   "regimes of a gated FFN, (gate, input) = (+,+), (+,−), (−,+), (−,−) (table "
                                   "sign_regimes). Gated FFNs only (dense, or a mixture of experts, each expert's gate "
                                   "recomputed from the block's input); the pass runs the eager forward.")
    samples_per_bin: int = setting(5, "Quantile samples kept per key, sign and histogram bin.",
                                   check=between(0, 1000))
    checkpoint_every: float = setting(60.0, "Seconds between checkpoints.", check=at_least(0), recorded=False)
    ray: str | None = setting(None, "Mine shards on Ray: auto, local, or a cluster ADDRESS. With a pre-tokenized "
                                    "corpus file, each actor decodes its own chunks; otherwise the driver prepares "
                                    "the corpus first.", recorded=False)
    shards: int | None = setting(None, "Number of shards with --ray (default: one per GPU of the cluster, each "
                                       "on its own actor; 2 on a cluster without GPUs).", check=at_least(1),
                                 recorded=False)
    workers: int | None = setting(None, "Processes that split and tokenize the corpus while the model mines (0: in "
                                        "this process; at most one per core; default: min(4, cores - 1) for text, 0 on "
                                        "two cores or fewer and for token ids, which only need decoding).",
                                  check=between(0, 256), recorded=False)
    prefetch: int | None = setting(None, "Chunks of the corpus a thread prepares ahead while the model mines (0: "
                                         "each when it is needed). Default: 2 on CUDA, where the host's work would "
                                         "otherwise leave the GPU idle, and 0 on a CPU, whose cores run the forward.",
                                   check=between(0, 64), recorded=False)
    chunk_sentences: int = setting(4096, "Sentences streamed per chunk: each chunk is split, tokenized, written and "
                                         "mined in turn, its batches packed within it (more: less padding, more "
                                         "host memory).", check=between(1, 1 << 24), recorded=False)
    pack: str | None = setting(None, "Short sentences side by side in rows of C tokens (the same tables): C, 0 "
                                     "(padded rows) or auto (rows of 128 and 256 tokens timed against padded rows "
                                     "on the first batches, the fastest kept). Default: FFKV_PACK, else auto on "
                                     "CUDA and 0 on a CPU.", parse=_switch("ffkv.mine.packing", "--pack"),
                               recorded=False)
    fused_kernels: str | None = setting(None, "The fused Triton trackers on CUDA (the same tables): 1, 0 or auto "
                                              "(timed against the portable trackers on the first batches). "
                                              "Default: FFKV_TRITON, else auto on CUDA.",
                                        parse=_switch("ffkv.mine.fused_cuda", "--fused-kernels"), recorded=False)
    compile_blocks: str | None = setting(None, "Each block through torch.compile (the same tables): 1, 0 or auto "
                                               "(once the other paths are chosen, their choice timed against its "
                                               "compiled twin; a compile takes seconds, so for long runs). "
                                               "Default: FFKV_COMPILE, else auto on CUDA (its trial after 20 s of "
                                               "mining, so short runs never compile) and 0 on a CPU.",
                                         flag="--compile",
                                         parse=_switch("ffkv.mine.compiled", "--compile"), recorded=False)

    # Fields added after runs were first recorded, with their defaults. The record (manifest
    # settings, `key()`) leaves a field out while it holds its default, so a run recorded before
    # the field existed has the same record as the same command typed today: it resumes, or is
    # skipped when done, instead of being refused as "other settings". Whether such a run has
    # the stats tables is told by the step's info (`stats` in the manifest), not by the record.
    ADDED = {"stats": True, "samples_per_bin": 5, "context": CORPUS_CONTEXT, "covariance": None,
             "regimes": False}

    def record(self) -> dict:
        """The settings that decide the tables (the recorded fields). `batch_tokens` is not among
        them: results do not depend on the batch layout, so a run mined with one budget counts as
        done, or resumes, under any other (the step's record carries a budget that runs recorded
        before issue 24 kept, `record` below)."""
        from ffkv.steps.settings import record

        check_batch_tokens(self.batch_tokens)
        d = record(self)
        for k, v in self.ADDED.items():
            if d.get(k) == v:
                d.pop(k)
        return d

    def key(self) -> str:
        """The settings' identity (the sentences table's `settings_key`); batch-free."""
        import hashlib

        return hashlib.sha256(json.dumps(self.record(), sort_keys=True).encode()).hexdigest()[:16]


def fit(s: MineSettings, mm) -> None:
    """--layers and --dims within the model (known only once it is open): one line otherwise."""
    for what, vals, upper in (("layers", s.layers, mm.n_layers), ("dims", s.dims, mm.d_m)):
        bad = [v for v in vals or () if not 0 <= v < upper]
        if bad:
            raise FfkvError(f"--{what} {bad[0]} out of range 0..{upper - 1}")
    if s.covariance:
        bad = [v for v in s.covariance if not 0 <= v < mm.n_layers]
        if bad:
            raise FfkvError(f"--covariance {bad[0]} out of range 0..{mm.n_layers - 1}")
        if s.layers is not None and not set(s.covariance) <= set(s.layers):
            raise FfkvError(f"--covariance {sorted(set(s.covariance) - set(s.layers))[0]} is not among --layers: "
                            "the second moment comes from the layers this pass mines")
        if s.dims is not None:
            raise FfkvError("--covariance needs every dim of its layers: leave out --dims")
    if s.regimes:
        from ffkv.mine.regimes import refusal

        why = refusal(mm, s.layers)
        if why:
            raise FfkvError(f"--regimes: {why}")


@dataclass(frozen=True)
class TrackerSpec:
    """A tracker of the mine step: the tables it writes, and whether the settings turn it on."""
    name: str
    tables: tuple[str, ...]
    enabled: Callable[[MineSettings], bool]


TRACKERS = (
    TrackerSpec("topk", ("triggers",), lambda s: True),
    TrackerSpec("stats", ("key_stats", "key_hist", "key_samples"), lambda s: s.stats),
    TrackerSpec("covariance", ("key_covariance",), lambda s: bool(s.covariance)),
    TrackerSpec("regimes", ("sign_regimes",), lambda s: bool(s.regimes)),
)
TABLES = ("sentences", "triggers", "vocab")  # always written: the topk tracker's and the corpus
STATS_TABLES = next(spec.tables for spec in TRACKERS if spec.name == "stats")
COVARIANCE_TABLES = next(spec.tables for spec in TRACKERS if spec.name == "covariance")
REGIMES_TABLES = next(spec.tables for spec in TRACKERS if spec.name == "regimes")


def _lens(v):
    return None if v in LENSES else f"must be naive or norm (got {v!r})"


@dataclass(frozen=True)
class MineCommand:
    """`ffkv mine`'s own options, beside the settings: where the run goes and how its model is read.
    `force` and `dtype` give the command's common options their meaning for mining."""
    out: Path = setting(..., "Run directory to create or resume.", short="-o")
    overwrite: bool = setting(False, "Start afresh in --out although it holds a run (or a damaged one): its "
                                     "manifest, checkpoint and tables are deleted first; annotations and files "
                                     "that are not ffkv's are kept.", flag="--overwrite")
    lens: str = setting("norm", LENS_HELP, check=_lens)
    force: bool = setting(False, "Mine again from scratch into the same run, with its own model and settings, "
                                 "replacing the step's tables (e.g. one that was damaged); without it a killed run "
                                 "resumes and a finished one is skipped.")
    dtype: str = setting("auto", "auto (bfloat16 on a CUDA device that supports it, float32 on a CPU; the manifest "
                                 "records the choice), float32, float16, bfloat16.")


def open_mine(o: MineCommand, s: MineSettings, model_name: str | None, device: str, dtype: str):
    """The run in --out (created, or resumed when it is a run of this model) and the model from
    --model, whose lens the run keeps; --layers and --dims checked against it first."""
    from ffkv.cli.options import model, open_run

    out = Path(o.out)
    if out.exists() and not out.is_dir():
        raise FfkvError(f"--out {out} exists and is not a directory")
    mm = model(model_name, device, dtype, o.lens)
    fit(s, mm)
    return open_run(out, create=True, overwrite=o.overwrite), mm


def record(run, s: MineSettings) -> dict:
    """The manifest's record of the mine step. A run recorded before issue 24 kept its
    `batch_tokens` (then part of the record); the budget changes speed only, so that value is
    carried over: such a run stays done, or resumes, under any budget."""
    r = s.record()
    prev = run.settings("mine") if run is not None else None
    if prev and "batch_tokens" in prev:
        r["batch_tokens"] = prev["batch_tokens"]
    return r


def done_info(run, st: dict) -> bool:
    """Done also needs the tables of the optional trackers that the step says it wrote."""
    tables = [*((st.get("stats") or {}).get("tables", STATS_TABLES) if st.get("stats") else ()),
              *((st.get("covariance") or {}).get("tables", ())),
              *((st.get("regimes") or {}).get("tables", ()))]
    return all(run.table_problem(t) is None for t in tables)


def rebuild(run) -> list[str]:
    """`ffkv mine`'s arguments that mine `run` again from scratch: its --out, its model, its lens
    and every recorded setting that differs from the command's default."""
    from ffkv.steps.settings import flags

    args = ["--out", str(run.path)]
    model = run.model_arg()
    if model:
        args += ["--model", str(model)]
    if run.lens != "norm":
        args += ["--lens", run.lens]
    return args + flags(MineSettings, run.settings("mine") or {})


def summary(run, out, s=None, as_json: bool = False) -> None:
    """What `ffkv mine` (and `reproduce`) prints: the corpus mined, the rows, the speed."""
    if as_json:
        print(json.dumps({"status": out.status, "info": out.info}, indent=2, default=str))
        return
    if out.skipped:
        print(f"mine: {run.path} is already mined with these settings; nothing to do")
    info = out.info
    corpus = run.manifest.get("corpus", {})
    c = corpus.get("counts", {})
    n = c.get("sentences")
    empty = f", {c['empty_rows']} empty row{'' if c['empty_rows'] == 1 else 's'} skipped" if c.get("empty_rows") else ""
    col = f", ids from column {corpus['column']}" if corpus.get("column") else ""  # never a silent guess
    print(f"mined {n} sentence{'' if n == 1 else 's'} ({c.get('tokens')} tokens, {c.get('truncated', 0)} truncated{empty}{col}) "
          f"into {run.path}: {info.get('rows')} trigger rows, "
          + (f"packed rows of {info['packed_rows']} tokens, " if info.get("packed_rows") else
             f"padding {info.get('padding_share', 0):.1%}, ")
          + ("fused kernels, " if info.get("fused_trackers") else "") +
          f"{info.get('tokens_per_s')} tok/s" + _tuned(info.get("tuning")))


def _tuned(t: dict | None) -> str:
    """The tuner's choice and its figures (`ffkv.mine.tune`), for the summary line."""
    if not t:
        return ""
    figs = ", ".join(f"{a['arm']} {a['tokens_per_s']:,.0f}" for a in t["arms"] if a.get("tokens_per_s"))
    if t.get("chosen") is None:  # a short pass: the first arm mined all but the trial's batches
        return f" (the corpus ended while timing: {figs} tok/s)" if figs else ""
    return f" ({t['chosen']} chosen on the first batches: {figs} tok/s)"


def reproduce(r, mm) -> MineSettings:
    """`ffkv reproduce`'s mining: its corpus, sentence count, seed and top-k; negatives when asked,
    or by default when the FFN is gated."""
    return MineSettings(corpus=r.corpus or DEFAULT_CORPUS, max_sentences=r.sentences, seed=r.seed,
                        top_k=r.top_k, negative=bool(r.negative or (r.negative is None and mm.gated)))


HELP = ("Find each key's top-t trigger prefixes in a corpus (the paper's §3.1).\n\n"
        "One forward pass per batch yields every prefix's coefficient (causal masking). "
        "Resumable: rerun the same command after a crash. Tables: sentences, triggers, vocab, and "
        "(unless --no-stats) key_stats, key_hist, key_samples; with --covariance, key_covariance; with --regimes, sign_regimes. --out must be a new or empty folder, "
        "or a run of this model.\n\n"
        "Faster paths, the same tables: --pack (FFKV_PACK), --fused-kernels (FFKV_TRITON) and --compile "
        "(FFKV_COMPILE); a flag wins over its variable. On CUDA, packing and the fused kernels default "
        "to auto: the first batches are mined by each combination in turn, timed, and the fastest "
        "mines the rest (recorded in the manifest as `tuning`). On a CPU both are off unless set. "
        "--compile auto then times the chosen path through torch.compile against it as it is; on CUDA "
        "it is the default, and its trial starts after 20 s of mining (a compile costs seconds and pays "
        "back only over long runs).")

STEP = Step(name="mine", settings=MineSettings, requires=(), tables=TABLES,
            compute=lazy("ffkv.steps.mine.compute:compute"), record=record,
            refuse_other_settings=True, done_info=done_info, help=HELP, command="ffkv mine --out {run}",
            cli=True, summary=summary, reproduce=reproduce, options=MineCommand, open=open_mine,
            rebuild=rebuild, sections=lazy("ffkv.steps.mine.report:sections"),
            report_before_done=True)

__all__ = ["MineSettings", "MineCommand", "STEP", "TABLES", "STATS_TABLES", "COVARIANCE_TABLES", "REGIMES_TABLES",
           "TRACKERS", "check_batch_tokens",
           "fit"]
