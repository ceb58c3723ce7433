"""Shared fixtures: tiny real models built from configs, a real tokenizer, the real SmolLM2."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# One pytest-xdist worker per core: each gets its share of the cores for torch's threads (and the
# processes it starts). Two workers of two threads each on two cores spin against each other in
# OpenMP's barriers: six test files took 174 s so, 135 s at one thread a worker.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _WORKERS)))

import ffkv  # noqa: E402, F401  first, so that its MKL_CBWR setting is in place before torch loads MKL

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("FFKV_SHARED", ROOT.parent / "shared"))
CORPORA = SHARED / "corpora"
WT2 = CORPORA / "wikitext-2"

ARCHS = ("gpt2", "gpt_neox", "opt", "llama")


def _tokenizer(path: Path):
    """A real byte-level BPE trained on WikiText-2, small enough for tiny models."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from ffkv.corpus.wikitext import detokenize, is_heading

    lines = [detokenize(l) for l in (WT2 / "wiki.train.tokens").read_text().split("\n")[:3000]
             if l.strip() and not is_heading(l)]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", bos_token="<|endoftext|>")
    fast.save_pretrained(path)
    return fast


def tiny_config(arch: str, vocab: int, **kw):
    import transformers as tf

    common = dict(vocab_size=vocab, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if arch == "gpt2":
        cfg = tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=128, n_inner=96,
                            activation_function="gelu_new", initializer_range=0.2, **common)
    elif arch == "gpt_neox":
        cfg = tf.GPTNeoXConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=96, max_position_embeddings=128,
                               use_parallel_residual=True, hidden_act="gelu",
                               initializer_range=0.2, **common)
    elif arch == "opt":
        cfg = tf.OPTConfig(hidden_size=32, num_hidden_layers=2, ffn_dim=96, num_attention_heads=4,
                           max_position_embeddings=128, word_embed_proj_dim=32,
                           do_layer_norm_before=True, activation_function="relu",
                           init_std=0.2, **common)
    elif arch == "llama":
        cfg = tf.LlamaConfig(hidden_size=32, intermediate_size=80, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=128, initializer_range=0.2,
                             tie_word_embeddings=False, **common)
    else:
        raise ValueError(arch)
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def build_tiny(arch: str, path: Path, tokenizer_dir: Path, seed: int = 0, **kw) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, len(tok), **kw))
    # Random norms and biases too, so that gains and biases are really exercised.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


# Files are handed to the workers longest first (LPT scheduling), so that the last file a worker
# starts is a short one and the two workers end together: worker seconds per file, measured on a
# whole run (`file_seconds.json`; refresh with `tests/file_seconds.py`). A file not in the table
# (a new one) counts as a middling one. At e958798, with only the ten longest ordered, one worker
# sat idle for the last ~90 s.
FILE_SECONDS = json.loads((Path(__file__).with_name("file_seconds.json")).read_text())
NEW_FILE_SECONDS = 20.0


def pytest_collection_modifyitems(config, items):
    """Every worker collects the same order (xdist checks), and loadfile hands files out in it."""
    def key(item):
        return -FILE_SECONDS.get(Path(str(item.fspath)).stem, NEW_FILE_SECONDS)

    items.sort(key=key)  # stable: within a file, and among the rest, the collected order


@pytest.fixture(autouse=True)
def _torch_threads_kept():
    """Each test leaves torch's thread count as it found it. An in-process Ray actor
    (`ShardMiner(threads=1)`) once set it to 1 for the rest of the session, and every later file
    ran on one core: test_values' SmolLM2 case took 184 s there against 96 s alone."""
    import torch

    n = torch.get_num_threads()
    yield
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("tok")
    _tokenizer(p)
    return p


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory, tok_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {a: build_tiny(a, root / a, tok_dir) for a in ARCHS}


@pytest.fixture(scope="session")
def tiny_models(tiny_dirs):
    from ffkv.model.memories import open_model

    return {a: open_model(str(p), device="cpu") for a, p in tiny_dirs.items()}


@pytest.fixture(scope="session")
def smollm2():
    from ffkv.model.memories import open_model

    return open_model(None, device="cpu")


def step_and_bare(src: Path, root: Path, *step) -> tuple[Path, Path]:
    """(a copy of run `src` with `ffkv STEP RUN ARGS…` done on it, an untouched copy): a browser's
    pages with and without a step."""
    import shutil

    run, bare = root / "run", root / "bare"
    shutil.copytree(src, run)
    shutil.copytree(src, bare)
    r = run_cli(step[0], run, *step[1:])
    assert r.returncode == 0, r.stderr
    return run, bare


def browser_client(run):
    """A test client of the browser on `run`, at the address its same-origin checks accept."""
    from fastapi.testclient import TestClient

    from ffkv.web.app import create_app

    return TestClient(create_app(run, log_fn=lambda m: None), base_url="http://127.0.0.1:8000")


def all_search(client, params) -> list[dict]:
    """Every result of one `/api/search` (a dict, pairs, or a query string), read page by page."""
    from urllib.parse import parse_qsl

    pairs = parse_qsl(params) if isinstance(params, str) else list(dict(params).items()) \
        if isinstance(params, dict) else list(params)
    rows, page = [], 1
    while True:
        r = client.get("/api/search", params=[*pairs, ("page", str(page)), ("per_page", "500")])
        assert r.status_code == 200, r.text
        d = r.json()
        rows += d["results"]
        if page * 500 >= d["total"]:
            return rows
        page += 1


def run_cli(*args, env=None, cwd=None, timeout=600, fresh=False) -> subprocess.CompletedProcess:
    """The real `ffkv` entry point (`ffkv.cli.main`, what the console script calls), with its exit
    code, stdout and stderr. It runs in this process, which saves a torch and transformers import
    (about 3 s) a call; a test that needs a process of its own (another environment or working
    directory, a kill, what gets imported) passes `env`, `cwd` or `fresh=True`.
    FFKV_TEST_CLI=subprocess runs every call in a process of its own, as before."""
    args = [str(a) for a in args]
    fresh = fresh or os.environ.get("FFKV_TEST_CLI") == "subprocess"
    if fresh or env is not None or cwd is not None:
        e = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
        return subprocess.run([sys.executable, "-m", "ffkv.cli", *args], capture_output=True,
                              text=True, env=e, cwd=cwd, timeout=timeout)
    return _run_in_process(args)


def kill_mine_when(out: Path, args, ready, wait: float = 120, settle: float = 0.0) -> subprocess.Popen:
    """Starts `ffkv mine --out out ARGS` in a process of its own and SIGKILLs it once `ready()` holds
    (polled every 50 ms, at most `wait` s, then `settle` s more): the resume tests' crash."""
    import signal
    import time

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    p = subprocess.Popen([sys.executable, "-m", "ffkv.cli", "mine", "--out", str(out), *map(str, args)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + wait
    while not ready() and time.time() < deadline and p.poll() is None:
        time.sleep(0.05)
    time.sleep(settle)
    assert p.poll() is None, "finished before it could be killed"
    p.send_signal(signal.SIGKILL)
    p.wait()
    return p


def mine_tiny(out: Path, model: Path, sentences: int, top_k: int, *extra) -> Path:
    """`ffkv mine` of the first `sentences` WikiText-2 valid sentences into `out`, which must work."""
    res = run_cli("mine", "--out", out, "--model", model, "--corpus", WT2 / "wiki.valid.tokens",
                  "--max-sentences", str(sentences), "--top-k", str(top_k), *extra)
    assert res.returncode == 0, res.stderr
    return out


SWITCHES = ("FFKV_PACK", "FFKV_COMPILE", "FFKV_TRITON")


def tiny_with_a_dead_memory(path: Path, tok_dir: Path, dead: tuple[int, int]):
    """A tiny Llama whose memory `dead` (layer, dim) has its gate row zeroed: m = silu(0)·(x·u) = 0
    on every token (the census's and the browser's census tests). Returns (path, the HF model)."""
    import torch
    from transformers import AutoModelForCausalLM

    build_tiny("llama", path, tok_dir)
    hf = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        hf.model.layers[dead[0]].mlp.gate_proj.weight[dead[1]] = 0
    hf.save_pretrained(path)
    return path, hf


@pytest.fixture(scope="session")
def reference_mine(tmp_path_factory):
    """`mine_tiny(model, sentences, top_k, *extra)` shared by the whole session: the plain pass
    that tests of packed rows, compiled blocks and the tuner compare against is mined once per
    setting (the switches in the environment included), not once per test. Read-only: a test that
    changes its run copies it first."""
    root = tmp_path_factory.mktemp("reference")
    done: dict = {}

    def get(model: Path, sentences: int, top_k: int, *extra) -> Path:
        key = (str(model), sentences, top_k, *map(str, extra), *(os.environ.get(k) for k in SWITCHES))
        if key not in done:
            done[key] = mine_tiny(root / str(len(done)), model, sentences, top_k, *extra)
        return done[key]

    return get


def _run_in_process(args: list[str]) -> subprocess.CompletedProcess:
    """`main(args)` with stdout and stderr captured; an exception that escapes `main` becomes what
    the process would have shown: its traceback on stderr and exit code 1."""
    import io
    import traceback

    from ffkv.cli import main

    out, err = io.StringIO(), io.StringIO()
    argv, sys.argv = sys.argv, ["ffkv", *args]
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(args)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if e.code is not None and not isinstance(e.code, int):
                    print(e.code, file=sys.stderr)
            except Exception:  # noqa: BLE001  (what the interpreter prints for an uncaught error)
                traceback.print_exc()
                code = 1
    finally:
        sys.argv = argv
    return subprocess.CompletedProcess(["ffkv", *args], code, out.getvalue(), err.getvalue())


def wikitext_sentences(n: int, split: str = "valid", seed: int = 0) -> list[str]:
    from ffkv.corpus.sources import open_corpus

    return [s.text for s in open_corpus(str(WT2 / f"wiki.{split}.tokens"), seed=seed).sentences(n)]


def free_port() -> int:
    """A loopback port free now (another process may still take it before we bind)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CHROMIUM = Path("/usr/bin/chromium")  # Debian's (`.ci/run` installs it); Playwright downloads none


@pytest.fixture(scope="module")
def browser():
    """Debian's chromium through Playwright, one per test module (skipped where it is missing)."""
    if not CHROMIUM.exists():
        pytest.skip("needs Debian's chromium (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    from ffkv.report.screenshot import BROWSER_ARGS

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=BROWSER_ARGS)
        try:
            yield b
        finally:
            b.close()


@contextlib.contextmanager
def serving(app, **config):
    """A real uvicorn server for `app` on a free loopback port, in a thread; yields its URL."""
    import threading
    import time

    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **config))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    assert server.started
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        th.join(10)


@contextlib.contextmanager
def serve_cli(run):
    """`ffkv serve RUN` as a user starts it, in a subprocess on a free loopback port; yields its URL."""
    import time

    import httpx

    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "ffkv.cli", "serve", str(run), "--port", str(port)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1200):
            try:
                if httpx.get(url + "/", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                if p.poll() is not None:
                    raise AssertionError(p.stderr.read())
                time.sleep(0.1)
        yield url
    finally:
        p.terminate()
        p.wait(10)


SMOLLM2_CUT_LAYERS = 4


@pytest.fixture(scope="session")
def smollm2_cut(smollm2, tmp_path_factory):
    """The real SmolLM2's first SMOLLM2_CUT_LAYERS layers, with its real embeddings (tied, 49,152
    tokens), final norm and tokenizer, saved as a folder: for tests that check each layer's
    arithmetic against brute force, where all 30 layers repeat the same check 7x over."""
    import torch
    from transformers import AutoModelForCausalLM

    from ffkv.model.memories import open_model

    cfg = smollm2.hf.config.__class__.from_dict(smollm2.hf.config.to_dict())
    cfg.num_hidden_layers = SMOLLM2_CUT_LAYERS
    for k in ("quantization_config",):
        if hasattr(cfg, k):
            delattr(cfg, k)
    with torch.device("meta"):
        cut = AutoModelForCausalLM.from_config(cfg)
    state = {k: v for k, v in smollm2.hf.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < SMOLLM2_CUT_LAYERS}
    cut.load_state_dict(state, strict=False, assign=True)
    cut.tie_weights()
    path = tmp_path_factory.mktemp("smollm2_cut")
    cut.save_pretrained(path)
    smollm2.tok.save_pretrained(path)
    mm = open_model(str(path), device="cpu")
    assert mm.n_layers == SMOLLM2_CUT_LAYERS
    return mm


def merges_bit_for_bit(fed, a, b, c) -> dict:
    """A mergeable tracker's property: `fed(batches)` states of three batch lists merged in every
    grouping and order give the same `arrays()`, bit for bit. Returns them."""
    import numpy as np

    first = fed(a).merge(fed(b)).merge(fed(c)).arrays()
    for got in (fed(a).merge(fed(b).merge(fed(c))), fed(c).merge(fed(a)).merge(fed(b)),
                fed(b).merge(fed(c).merge(fed(a)))):
        arrs = got.arrays()
        assert set(arrs) == set(first)
        for k in first:
            assert np.array_equal(arrs[k], first[k]), k
    return first
