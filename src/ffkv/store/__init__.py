"""The run directory: `Run` (manifest, atomic writes, locks), the read API (`query`), annotations.

`Run`, `atomic_write_bytes` and `atomic_write_json` are importable from here, loaded on first
use so that importing a submodule (the step lifecycle, for `ffkv --help`) does not load pyarrow."""
__all__ = ["Run", "atomic_write_bytes", "atomic_write_json"]


def __getattr__(name):
    if name in __all__:
        from ffkv.store import run

        return getattr(run, name)
    raise AttributeError(name)
