from ffkv.model.arch import ARCHITECTURES, Architecture
from ffkv.model.load import load_model, resolve_default_model, ModelSpec
from ffkv.model.memories import MemoryModel, Captures, Lens

__all__ = ["ARCHITECTURES", "Architecture", "load_model", "resolve_default_model", "ModelSpec",
           "MemoryModel", "Captures", "Lens"]
