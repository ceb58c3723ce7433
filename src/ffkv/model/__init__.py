"""Models as key-value memories. Names load lazily (PEP 562), so that importing the CLI or the
browser does not pay for torch before a command needs a model."""
from importlib import import_module

_WHERE = {"ARCHITECTURES": "arch", "Architecture": "arch", "load_model": "load", "resolve_default_model": "load",
          "ModelSpec": "load", "MemoryModel": "memories", "Captures": "memories", "Lens": "memories"}
__all__ = list(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(import_module(f"ffkv.model.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'ffkv.model' has no attribute {name!r}")
