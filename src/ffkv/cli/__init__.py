"""The `ffkv` command line. Thin: it parses, calls the library, prints."""
from __future__ import annotations

import importlib
import os
import sys
import warnings
import typer

from ffkv.errors import FfkvError

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

app = typer.Typer(
    name="ffkv", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
    help="Read a transformer LM's feed-forward layers as key-value memories (Geva et al. 2021).\n\n"
         "Typical flow: `ffkv mine --out RUN`, then `ffkv values RUN`, `ffkv compose RUN`, "
         "`ffkv mutate RUN`, `ffkv patterns RUN`, `ffkv report RUN`; or all of it with "
         "`ffkv reproduce RUN`.")

from ffkv.cli.options import DeviceOpt, DtypeOpt, LensOpt, ModelOpt, model  # noqa: E402,F401
from ffkv.model.load import quiet_hf  # noqa: E402,F401


def _add_step_commands() -> None:
    """A command for each registered step, built-in or plugin, generated from its settings
    (`ffkv.steps.cli`): no step has a module here. A plugin that fails to load is named on stderr
    and leaves the other commands working. Adding twice adds nothing."""
    from ffkv.steps.cli import register_all

    taken = {c.name or c.callback.__name__ for c in app.registered_commands} | \
        {g.name for g in app.registered_groups if g.name}
    try:
        register_all(app, taken)
    except FfkvError as e:
        print(f"ffkv: warning: {_one_line(e)}", file=sys.stderr)



def _user_os_error(e: OSError) -> str | None:
    """An OSError the user's own paths cause (a name too long, no permission, a full disk), as one
    line; None for any other, which is a bug and keeps its traceback."""
    import errno

    from ffkv.atomic import USER_ERRNOS
    from ffkv.display import printable

    if e.errno not in USER_ERRNOS | {errno.ENAMETOOLONG, errno.ELOOP}:
        return None
    name = printable(str(e.filename), newlines=False) if e.filename else ""
    name = name if len(name) <= 80 else name[:77] + "..."
    return f"{os.strerror(e.errno).lower()}" + (f": {name}" if name else "")


def _command_of(argv: list[str] | None):
    """The click command that `argv` (else the process's arguments) runs, or None: the first
    word that names one of the app's commands."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        group = typer.main.get_command(app)
        commands = getattr(group, "commands", {})
    except Exception:  # noqa: BLE001 - no command known: the hint names no option
        return None
    return next((commands[a] for a in map(str, args) if a in commands), None)


def _options_of(command) -> set[str]:
    """Every option name (`--batch-tokens`, ...) that `command` takes."""
    return {o for p in getattr(command, "params", ()) for o in (*getattr(p, "opts", ()), *getattr(p, "secondary_opts", ()))
            if o.startswith("-")}


def _out_of_memory(e: BaseException, argv: list[str] | None = None) -> str | None:
    """Running out of device or host memory (a budget too large for this machine, or another
    process holding the GPU) as one line with what to do, naming only options the failing command
    (from `argv`) has; None for any other error."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(e, torch.OutOfMemoryError):
        where = "GPU"
    elif isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and "can't allocate memory" in str(e)):
        where = "host"
    else:
        return None
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    command = _command_of(argv)
    if command is not None and "--batch-tokens" in _options_of(command):
        resume = " (mine resumes its checkpoint only under the budget it began with)" if command.name == "mine" else ""
        return f"out of {where} memory ({first}); free some, or pass a smaller --batch-tokens{resume}"
    return f"out of {where} memory ({first}); free some memory, or give it a smaller input"


def _click_errors() -> tuple[type, ...]:
    """click's usage-error base classes: typer ≥ 0.20 vendors its own copy beside click's."""
    out = []
    for name in ("click.exceptions", "typer._click.exceptions"):
        try:
            out.append(importlib.import_module(name).ClickException)
        except (ImportError, AttributeError):
            pass
    return tuple(out)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _interrupted() -> None:
    print("ffkv: interrupted; rerun the same command to resume", file=sys.stderr)
    sys.exit(130)


def main(argv: list[str] | None = None) -> None:
    """The entry point: every error a user can cause ends as one line on stderr and exit code 2."""
    _add_step_commands()
    # the CLI owns its process: a library's warning is noise on a terminal, and what matters ffkv
    # says itself (`ffkv.errors.notice`); a library caller keeps its own (`quiet_hf`)
    warnings.filterwarnings("ignore")
    try:
        rv = app(args=argv, standalone_mode=False)
    except FfkvError as e:
        print(f"ffkv: error: {_one_line(e)}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        _interrupted()
    except SystemExit:
        raise
    except OSError as e:
        why = _user_os_error(e)
        if why is None:
            raise
        print(f"ffkv: error: {why}", file=sys.stderr)
        sys.exit(2)
    except Exception as e:  # click's and typer's own exceptions arrive here in non-standalone mode
        kind = type(e).__name__
        if kind == "NoArgsIsHelpError" and getattr(e, "ctx", None) is not None:
            print(e.ctx.get_help())
            sys.exit(0)
        if kind == "Abort":
            _interrupted()
        if kind == "Exit":
            sys.exit(getattr(e, "exit_code", 0))
        if isinstance(e, _click_errors()):
            ctx = getattr(e, "ctx", None)
            where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            print(f"ffkv: error: {_one_line(e.format_message())}{where}", file=sys.stderr)
            sys.exit(2)
        why = _out_of_memory(e, argv)
        if why is not None:
            print(f"ffkv: error: {_one_line(why)}", file=sys.stderr)
            sys.exit(2)
        raise
    # In non-standalone mode typer returns an exit code instead of raising: a Ctrl-C comes
    # back as 130 with nothing printed.
    if isinstance(rv, int) and rv != 0:
        if rv == 130:
            _interrupted()
        sys.exit(rv)


# The commands on a model or a corpus, then every step's, then those on a run; one module a group.
importlib.import_module("ffkv.cli.info").register(app)
_add_step_commands()
for _mod in ("show", "annotate", "report", "reproduce", "serve", "repair"):
    importlib.import_module(f"ffkv.cli.{_mod}").register(app)
