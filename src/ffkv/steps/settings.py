"""A step's settings, written once: one frozen dataclass whose fields carry their help, their
check and whether the manifest records them. The CLI (`ffkv.steps.cli`), the library and
`reproduce` all read the same fields, so a default or a check cannot drift between them.

    @dataclass(frozen=True)
    class CountSettings:
        top: int = setting(10, "Trigger ranks to read per key.", check=at_least(1))
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ffkv.errors import FfkvError

META = "ffkv"  # the key of a field's metadata that holds its Setting


@dataclasses.dataclass(frozen=True)
class Setting:
    help: str = ""
    check: Callable[[Any], str | None] | None = None  # value -> error text (None: fine)
    recorded: bool = True  # part of the manifest's record (False: speed or display only)
    flag: str | None = None  # the CLI flag, when not --field-name
    short: str | None = None  # e.g. "-n"
    parse: Callable[[str], Any] | None = None  # CLI text -> value (ranges, lists); the option is then a string
    shown: Any = None  # the CLI default when it is not the field's (a parsed field: as typed, "+" for sign 1)
    reproduce: "Flag | None" = None  # an `ffkv reproduce` option giving this field (`setting(..., reproduce=)`)


_FIELDS = object()  # Flag: "as the field's"


@dataclasses.dataclass(frozen=True)
class Flag:
    """A settings field as an `ffkv reproduce` option: its flag (default: the field's), reproduce's
    default and help when they differ from the command's, the value each named preset gives it
    (`--preset full`), and its range (typer's min and max). The value reaches the step's
    `Step.reproduce(r, model)` as `r.NAME`, NAME the flag without its dashes ("--top-k": top_k).
    Fields of several steps naming one flag share it (compose's and normalize's held-out corpus)."""
    name: str | None = None
    default: Any = _FIELDS
    help: str | None = None
    presets: dict = dataclasses.field(default_factory=dict)
    min: Any = None
    max: Any = None
    short: str | None = None


def setting(default, help: str = "", *, check=None, recorded: bool = True, flag: str | None = None,
            short: str | None = None, parse=None, shown: str | None = None, reproduce=None):
    """A dataclass field with its help, its check and whether it is recorded. `reproduce`: True (an
    `ffkv reproduce` option like the command's), a flag name ("--prefixes") or a `Flag`."""
    if reproduce is True:
        reproduce = Flag()
    elif isinstance(reproduce, str):
        reproduce = Flag(reproduce)
    return dataclasses.field(default=default,
                             metadata={META: Setting(help, check, recorded, flag, short, parse, shown, reproduce)})


def spec(f: dataclasses.Field) -> Setting:
    return f.metadata.get(META) or Setting()


def flag(f: dataclasses.Field) -> str:
    """The field's CLI flag (for a switch written "--on/--off", the whole pair)."""
    return spec(f).flag or "--" + f.name.replace("_", "-")


def flag_name(f: dataclasses.Field) -> str:
    """The flag as named in messages: "--on" of "--on/--off"."""
    return flag(f).split("/")[0]


def at_least(lo):
    def check(v):
        return None if v is None or v >= lo else f"must be at least {lo} (got {v})"
    check.range = f"x>={lo}"  # shown in the command's --help
    return check


def between(lo, hi):
    def check(v):
        return None if v is None or lo <= v <= hi else f"must be between {lo} and {hi} (got {v})"
    check.range = f"{lo}<=x<={hi}"
    return check


INT_LIMIT = 2**53  # no count, size or index of ffkv's comes near it; numpy and torch overflow past 2**63
SEED_MAX = 2**32 - 1  # numpy's SeedSequence refuses negatives; torch's seeds stop at 2**64


def a_seed(v):
    return between(0, SEED_MAX)(v)


a_seed.range = f"0<=x<={SEED_MAX}"


def check(settings) -> None:
    """Every field's own check, before any model loads: the first failure as one line."""
    if not dataclasses.is_dataclass(settings):
        return
    for f in dataclasses.fields(settings):
        s = spec(f)
        v = getattr(settings, f.name)
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > INT_LIMIT:
            raise FfkvError(f"{flag_name(f)} is too large (got {v}; at most {INT_LIMIT:,})")
        if s.check is not None:
            err = s.check(getattr(settings, f.name))
            if err:
                raise FfkvError(f"{flag_name(f)} {err}")


def record(settings) -> dict:
    """What the manifest keeps: the recorded fields (all of a plain dataclass's)."""
    return {f.name: _plain(getattr(settings, f.name)) for f in dataclasses.fields(settings) if spec(f).recorded}


def _plain(v):
    return list(v) if isinstance(v, tuple) else v


def a_sign(v):
    """A trigger list's sign: 1 (top positive) or -1 (most negative)."""
    return None if v in (1, -1) else f"must be + or - (1 or -1), not {v!r}"


def budget(lo: int):
    """(parse, check) of a --batch-tokens option: 'auto' or a whole number >= lo. auto sizes
    batches from the device (`ffkv.corpus.batching`); a number changes speed and memory only."""
    def parse(v):
        if v == "auto":
            return v
        if isinstance(v, str):
            try:
                v = int(v)
            except ValueError:
                v = None
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise FfkvError(f"--batch-tokens must be auto or a whole number of at least {lo}, not {v!r}")
        return v

    def check(v):
        try:
            parse(v)
        except FfkvError as e:
            return str(e).split(" ", 1)[1]  # the field's check names the flag itself
        return None
    return parse, check


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return ...


def cli_default(f: dataclasses.Field):
    """The field's default on the command line (`shown` where it differs from the library's)."""
    s = spec(f)
    return s.shown if s.shown is not None and s.parse is None else _default(f)


def flags(cls, record: dict) -> list[str]:
    """The command-line flags that give the fields of `record` (a recorded settings dict of the
    dataclass `cls`) where they differ from the command's defaults: a switch as its on or off
    flag, a list as comma-separated values (the form --layers and --dims parse). A field recorded
    under its flag's name (compose's n_prefixes as "prefixes") is found by it. Here, beneath the CLI and the lifecycle, since
    both use it (a rebuild command names these flags)."""
    out = []
    for f in dataclasses.fields(cls):
        key = f.name if f.name in record else flag_name(f).lstrip("-").replace("-", "_")
        if not spec(f).recorded or key not in record:
            continue
        v, d = record[key], cli_default(f)
        if v is None or v == d or (isinstance(v, list) and not v):
            continue
        fl = flag(f)
        if isinstance(v, bool):
            on, _, off = fl.partition("/")
            out.append(on if v else (off or "--no-" + on[2:]))
        elif isinstance(v, (list, tuple)):
            out += [flag_name(f), ",".join(str(x) for x in v)]
        else:
            out += [flag_name(f), str(v)]
    return out
