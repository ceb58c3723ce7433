"""`ffkv serve RUN`: the memory browser (FastAPI under uvicorn), reading the run directory only."""
from __future__ import annotations

import errno
import sys
from typing import List, Optional

import typer

from ffkv.errors import FfkvError

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def passive_openmp() -> None:
    """Let torch's OpenMP workers sleep instead of spinning while they wait (`OMP_WAIT_POLICY=
    PASSIVE`, unless the environment says otherwise): a server's forward passes (a page's colours,
    the explorer) are short bursts beside request threads and other processes, and spinning
    workers that wait on a descheduled peer made them 3× slower on a busy 2-core machine (SmolLM2,
    40 sentences to layer 15: 12 s passive against 38 s, load average 17). It takes effect only
    before torch is imported, which `ffkv serve` does later."""
    import os

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def bind_error(host: str, port: int, e: OSError) -> FfkvError:
    """One line for a failed bind that names what to change: the port when it is taken (or
    privileged), the host otherwise (not an address of this machine, or no such name)."""
    import socket

    why = e.strerror or str(e)
    if isinstance(e, socket.gaierror):
        return FfkvError(f"cannot listen on {host}:{port}: --host {host} is not a known name or address ({why})")
    if e.errno == errno.EADDRINUSE:
        return FfkvError(f"cannot listen on {host}:{port} ({why}); pick another --port")
    if e.errno == errno.EACCES and 0 < port < 1024:
        return FfkvError(f"cannot listen on {host}:{port} ({why}): ports below 1024 need privileges; "
                         "pick another --port")
    return FfkvError(f"cannot listen on {host}:{port} ({why}): --host {host} is not an address of this "
                     "machine; pick another --host (the default 127.0.0.1 serves this machine only)")


def serve(run: str = typer.Argument(..., metavar="RUN", help="A run directory made by `ffkv mine --out RUN` "
                                                             "(other steps add to the pages)."),
          host: str = typer.Option("127.0.0.1", "--host", help="Interface to bind. Anything but loopback "
                                   "exposes the pages and the annotation form to the network, and needs "
                                   "--allow-remote."),
          allow_remote: bool = typer.Option(False, "--allow-remote", help="Allow a --host other than loopback: "
                                            "every request then needs an access token, printed once in the "
                                            "URL (as Jupyter does)."),
          allowed_host: Optional[List[str]] = typer.Option(None, "--allowed-host", help="With --allow-remote: a "
                                                           "Host name clients use to reach the server (repeatable; "
                                                           "default: the --host value). Other names are refused "
                                                           "(DNS rebinding)."),
          port: int = typer.Option(8000, "--port", min=0, max=65535, help="TCP port (0: any free port)."),
          open_: bool = typer.Option(False, "--open", help="Open the overview in a web browser."),
          build_index: bool = typer.Option(False, "--build-index", help="Build the token index now (in memory; "
                                           "loads the model) when the run has no `value_index` table, "
                                           "instead of on the first token search."),
          index_k: Optional[int] = typer.Option(None, "--index-k", min=1, max=1000,
                                                help="Ranks kept by an index built in memory (default 20)."),
          load_model: bool = typer.Option(True, "--load-model/--lazy-model",
                                          help="Load the model and the trigger-text index in the background as "
                                               "the server starts, so that the explorer's, verify's and text "
                                               "search's first answer does not wait for them; --lazy-model: on "
                                               "first use.")):
    """Browse every memory as a page: triggers, value distributions, agreement, patterns,
    mutations, annotations; search by token, trigger text or measure. Writes only the run's
    annotations.sqlite (the annotation form)."""
    passive_openmp()  # before anything imports torch
    import secrets
    import socket

    from ffkv.web.app import LOOPBACK_NAMES, WILDCARD_HOSTS, is_loopback

    host = host.strip()
    remote = not is_loopback(host)
    if remote and not allow_remote:
        raise FfkvError(f"--host {host} would serve this run to other machines; add --allow-remote (every "
                        "request then needs a printed access token) or keep the default 127.0.0.1")
    if allowed_host and not remote:
        raise FfkvError("--allowed-host is for --host beyond loopback (with --allow-remote)")
    hosts = None
    if remote:
        hosts = [h.strip() for h in allowed_host or [] if h.strip()]
        if not hosts:  # the --host value; for a wildcard bind, this machine's names
            hosts = [host] if host not in WILDCARD_HOSTS else list(dict.fromkeys(
                h for h in (socket.gethostname(), socket.getfqdn()) if h and not is_loopback(h)))
        bad = [h for h in hosts if "*" in h or "/" in h or " " in h]
        if bad:
            raise FfkvError(f"--allowed-host {bad[0]!r}: give a name or address clients use, not a pattern")
        if not hosts:
            raise FfkvError(f"--host {host} listens on every interface: name the host clients use with "
                            "--allowed-host NAME (repeatable)")
        hosts += [h for h in LOOPBACK_NAMES if h not in hosts]
    try:  # fail early and in one line when the address cannot be bound
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(fam, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
            port = s.getsockname()[1]
    except OSError as e:
        raise bind_error(host, port, e) from None

    import uvicorn

    from ffkv.web.app import create_app

    token = secrets.token_urlsafe(32) if remote else None
    app = create_app(run, host=host, allowed_hosts=hosts, token=token, index_k=index_k, build_index=build_index)
    name = hosts[0] if remote else ("127.0.0.1" if host in WILDCARD_HOSTS else host)
    shown = f"[{name}]" if ":" in name else name
    url = f"http://{shown}:{port}/" + (f"?token={token}" if token else "")
    if remote:
        print(f"ffkv serve: serving {host} to other machines; every request needs the access token in this "
              f"URL (printed once); Host names accepted: {', '.join(hosts)}", file=sys.stderr)
    b = app.state.browser
    print(f"ffkv serve: {run} ({b.L} layers × {b.d_m} memories, {b.trig.table.num_rows:,} trigger rows, "
          f"loaded in {b.load_seconds} s) at {url}  (Ctrl-C stops)", file=sys.stderr, flush=True)
    if load_model:
        import threading

        threading.Thread(target=_preload, args=(b,), name="ffkv-preload", daemon=True).start()
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    if open_:
        import threading
        import webbrowser

        def opener():
            import time

            for _ in range(100):
                if server.started:
                    webbrowser.open(url)
                    return
                time.sleep(0.05)

        threading.Thread(target=opener, daemon=True).start()
    server.run()


def _preload(b) -> None:
    """What the first explorer request or text search would otherwise wait for (SmolLM2: ~20 s on
    a 2-core CPU). A failure is only a warning: the page that needs the model says why."""
    try:
        from ffkv.web import textindex

        b.model()
        ti = textindex.get(b)
        if ti is not None:
            ti.text()
    except Exception as e:  # noqa: BLE001  (a broken model must not stop the browser)
        print(f"ffkv serve: warning: could not preload the model ({type(e).__name__}: {e}); "
              "pages that need it will say why", file=sys.stderr, flush=True)


def register(app: typer.Typer) -> None:
    app.command()(serve)
