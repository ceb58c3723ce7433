"""`ffkv serve RUN`: the memory browser (FastAPI under uvicorn), reading the run directory only."""
from __future__ import annotations

import sys
from typing import Optional

import typer

from ffkv.errors import FfkvError

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def serve(run: str = typer.Argument(..., metavar="RUN", help="A run directory made by `ffkv mine --out RUN` "
                                                             "(other steps add to the pages)."),
          host: str = typer.Option("127.0.0.1", "--host", help="Interface to bind. Anything but loopback "
                                   "exposes the pages and the annotation form to the network."),
          port: int = typer.Option(8000, "--port", min=0, max=65535, help="TCP port (0: any free port)."),
          open_: bool = typer.Option(False, "--open", help="Open the overview in a web browser."),
          build_index: bool = typer.Option(False, "--build-index", help="Build the token index now (in memory; "
                                           "loads the model) when the run has no `value_index` table, "
                                           "instead of on the first token search."),
          index_k: Optional[int] = typer.Option(None, "--index-k", min=1, max=1000,
                                                help="Ranks kept by an index built in memory (default 20).")):
    """Browse every memory as a page: triggers, value distributions, agreement, patterns,
    mutations, annotations; search by token, trigger text or measure. Writes only the run's
    annotations.sqlite (the annotation form)."""
    import socket

    import uvicorn

    from ffkv.web.app import create_app

    if host not in LOOPBACK:
        print(f"ffkv serve: warning: binding {host} exposes the browser, and its annotation form, to "
              f"every machine that can reach this one; use the default 127.0.0.1 unless you mean it",
              file=sys.stderr)
    try:  # fail early and in one line when the port is taken
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(fam, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
            port = s.getsockname()[1]
    except OSError as e:
        raise FfkvError(f"cannot listen on {host}:{port} ({e.strerror or e}); pick another --port") from None
    app = create_app(run, host=host, index_k=index_k, build_index=build_index)
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else shown}:{port}/"
    b = app.state.browser
    print(f"ffkv serve: {run} ({b.L} layers × {b.d_m} memories, {b.trig.table.num_rows:,} trigger rows, "
          f"loaded in {b.load_seconds} s) at {url}  (Ctrl-C stops)", file=sys.stderr, flush=True)
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


def register(app: typer.Typer) -> None:
    app.command()(serve)
