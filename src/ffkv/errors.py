"""User-caused errors: the CLI turns them into one line and exit code 2."""


class FfkvError(Exception):
    """A problem the user can fix (bad path, bad flag, wrong run). Never a bug."""


_said: set[str] = set()


def notice(msg: str) -> None:
    """One line on stderr, once per process: what ffkv chose for the user (a fallback), which
    `warnings` would not show, since the CLI silences transformers' warnings wholesale."""
    import sys

    if msg not in _said:
        _said.add(msg)
        print(f"ffkv: {msg}", file=sys.stderr, flush=True)
