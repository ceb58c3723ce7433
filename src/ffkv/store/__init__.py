from ffkv.store.run import Run, atomic_write_bytes, atomic_write_json

__all__ = ["Run", "atomic_write_bytes", "atomic_write_json"]
