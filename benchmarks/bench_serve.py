"""Benchmark of `ffkv serve` (the memory browser) on a real run, measured side by side in one run.

    .venv/bin/python benchmarks/bench_serve.py --run runs/default [--pages 500] [--direct]
    .venv/bin/python benchmarks/bench_serve.py --run runs/default --text-load [--clients 20] [--text-requests 10]
    .venv/bin/python benchmarks/bench_serve.py --run runs/default --base /tmp/base [--clients 20] [--requests 10]
    .venv/bin/python benchmarks/bench_serve.py --run runs/default --colour [--pages 20]

It starts `ffkv serve RUN` as a user would (a subprocess on a free localhost port) and reads the
server's own time of each response from its `Server-Timing` header (the client's wall time is
printed beside it). Goals (issue 16), against the default run (46,080 memories, 4.6M trigger rows):
- startup: from starting the command to the first page ≤ 5 s;
- memory page: server time median ≤ 30 ms and p99 ≤ 150 ms over `--pages` random memories;
- token search over all 46,080 values ≤ 300 ms (with the token index in memory: read from the
  run's `value_index` table, or built by the server on first use, whose build time is printed);
- concurrency: 50 concurrent page requests all get 200.
With `--direct`, the same token's exact ranks computed directly (all values projected onto the
vocabulary, as without an index) are timed in this process, for the ratio.

With `--text-load` (issue 27 item 10: text search at 20 concurrent clients ≤ 0.2× the scan's p99), only
text search under load, before and after, side by side on the same run: the server is started twice,
once with `FFKV_TEXT_SEARCH=scan` (the reference scan: every sentence read, then DuckDB grouping under
one lock) and once with the text index (`ffkv.web.textindex`, built on the first text search; its build
time is printed). Each of `--clients` concurrent clients sends `--text-requests` searches
(`/api/search?text=WORD`, words from TOKENS, each client starting at another word); the first answer
to each word is compared between the two servers (the same JSON, or the run stops). p50 and p99 of the
client's wall time and the server's time, and their ratios, are printed.
With `--base TREE` (issue 26: warm pages under load, before and after), two servers on the same run,
one after the other: `ffkv serve` from TREE (PYTHONPATH=TREE/src, checked as bench_reproduce.py
does) and from `--new` (default: this checkout). Each side first requests every URL once and
waits until the server is idle (what it builds in the background on first use, e.g. similar
memories from the model's weights, is done: warm), then `--clients` concurrent clients send `--requests` requests each of every kind in turn: memory
pages (`--pages` random mined memories), layer pages (every layer) and search pages (text search,
and token search: from the run's `value_index`, or from the index each server builds in memory on
the first token search, whose 503s while it builds are asked again once the server is idle;
TOKENS as queries). p50 and p99 of the client's
wall time and the server's time per kind and side, and the ratios new/base, are printed; a kind
the base does not serve (404: no layer page before issue 26) is said so, with no ratio.

With `--colour` (issue 26's goal: a memory page of the default run fully coloured within 3 s of a
cold request, at once when cached; issue 48 item 8: layers 20–29 too; `--layers 20-29` picks
only those), two servers of this checkout one after the other, the first running every block
below each memory (FFKV_STREAM=off), the second starting deep memories from the run's stored
residual stream (`ffkv.web.residuals`). Each, after the model is loaded (one colouring request
for another memory) and the server has gone idle, for each of `--pages` random mined memories not asked
before, the page and then the colours' JSON its `data-act-src` names, as the page's script asks
for them; the time from sending the page request to the last byte of the colours is that memory's
"fully coloured" time (the script's painting is not counted: a few hundred class changes). Then
the same again, cached.
Speeds are goals, never timed assertions in tests.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from _common import ROOT, out

GOALS = {"startup_s": 5.0, "page_median_ms": 30.0, "page_p99_ms": 150.0, "token_ms": 300.0}
TOKENS = ["the", "of", "Paris", "river", "war", "music", "1990", "he", "city", "played", "king", "water",
          "film", "church", "German", "team", "school", "gold", "north", "computer"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_ms(r) -> float:
    m = re.search(r"dur=([0-9.]+)", r.headers.get("server-timing", ""))
    return float(m.group(1)) if m else float("nan")


def stats(xs) -> str:
    a = np.asarray(xs, dtype=np.float64)
    return (f"median {np.median(a):.1f} ms, p90 {np.percentile(a, 90):.1f} ms, p99 {np.percentile(a, 99):.1f} ms, "
            f"max {a.max():.1f} ms (n={len(a)})")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc), to read beside wall times on a busy machine."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def start(run: Path, port: int, env: dict | None = None):
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "ffkv.cli", "serve", str(run), "--port", str(port)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         env={**os.environ, **(env or {})})
    return p, t0


def pct(xs, q: float) -> float:
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q))


def text_load(run: Path, clients: int, per_client: int) -> None:
    """Text search under `clients` concurrent clients, the reference scan then the index (see the
    module docstring); prints both and the ratios."""
    import httpx

    words = TOKENS
    res: dict[str, dict] = {}
    answers: dict[str, dict] = {}
    for name, env in (("scan (before)", {"FFKV_TEXT_SEARCH": "scan"}), ("index (after)", {"FFKV_TEXT_SEARCH": "index"})):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        p, t0 = start(run, port, env)
        try:
            with httpx.Client(timeout=600) as client:
                wait_first_page(client, url, p, t0)
                t = time.perf_counter()
                first = client.get(url + "/api/search", params={"text": words[0]})
                first_s = time.perf_counter() - t
                got = {words[0]: first.json()}
                for w in words[1:]:  # one answer per word, sequentially: compared, and everything warm
                    got[w] = client.get(url + "/api/search", params={"text": w}).json()
            answers[name] = got

            async def one(c, i):
                out = []
                for j in range(per_client):
                    w = words[(i + j) % len(words)]
                    t = time.perf_counter()
                    r = await c.get("/api/search", params={"text": w})
                    out.append((1000 * (time.perf_counter() - t), server_ms(r), r.status_code))
                return out

            async def load():
                async with httpx.AsyncClient(base_url=url, timeout=600,
                                             limits=httpx.Limits(max_connections=clients)) as c:
                    t = time.perf_counter()
                    rs = await asyncio.gather(*(one(c, i) for i in range(clients)))
                    return [x for r in rs for x in r], time.perf_counter() - t

            cpu0 = cpu_seconds(p.pid)
            rows, wall = asyncio.run(load())
            cpu = cpu_seconds(p.pid) - cpu0
        finally:
            p.terminate()
            p.wait(10)
        w_ms, s_ms, codes = zip(*rows)
        res[name] = {"wall": w_ms, "server": s_ms}
        out(f"text search, {name}: first search {first_s:.2f} s"
            + (" (includes building the index)" if "index" in name else "")
            + f"; {clients} concurrent clients × {per_client} searches: {sum(c == 200 for c in codes)}/{len(codes)} × 200 "
            f"in {wall:.1f} s ({len(codes) / wall:.1f} searches/s, server CPU {1000 * cpu / len(codes):.0f} ms per search)")
        out(f"  client wall time: p50 {pct(w_ms, 50):.0f} ms, p99 {pct(w_ms, 99):.0f} ms; "
            f"server time: p50 {pct(s_ms, 50):.1f} ms, p99 {pct(s_ms, 99):.1f} ms")
    a, b = answers.values()
    same = [w for w in words if a[w] == b[w]]
    if len(same) != len(words):
        raise SystemExit(f"the index's answers differ from the scan's for: {[w for w in words if a[w] != b[w]]}")
    out(f"answers: identical JSON for all {len(words)} words "
        f"(triggers matched per word: median {np.median([a[w].get('triggers_matched', 0) for w in words]):,.0f})")
    before, after = res["scan (before)"], res["index (after)"]
    for k in ("wall", "server"):
        out(f"ratio after/before, {'client wall' if k == 'wall' else 'server'} time: "
            f"p50 {pct(after[k], 50) / pct(before[k], 50):.3f}, p99 {pct(after[k], 99) / pct(before[k], 99):.3f} "
            f"(goal: p99 ≤ 0.2)")


def wait_idle(pid: int, timeout: float = 1200, busy: float = 0.1) -> float:
    """Seconds until the server's own work in the background (the model, similar memories, text
    and token indexes, whatever its version starts) is done: its CPU under `busy` of a core over
    two seconds."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        c = cpu_seconds(pid)
        time.sleep(2)
        if cpu_seconds(pid) - c < 2 * busy:
            break
    return time.perf_counter() - t0


def load_side(url: str, pid: int, kinds: dict[str, list[str]], clients: int, per_client: int) -> dict:
    """Every URL once (warm; its status kept), the server left to finish what it does in the
    background, then for each kind `clients` concurrent clients × `per_client` requests (URLs in
    turn, each client starting elsewhere): {kind: {wall, server, codes, warm_status}}."""
    import httpx

    res = {}
    with httpx.Client(base_url=url, timeout=600) as c:
        warm = {k: [c.get(u).status_code for u in us] for k, us in kinds.items()}
        out(f"  warm: every URL once, then {wait_idle(pid):.0f} s until the server was idle")
        for k, us in kinds.items():  # a 503 while the server built something (the token index): ask again
            if any(code == 503 for code in warm[k]):
                warm[k] = [c.get(u).status_code for u in us]
    for kind, urls in kinds.items():
        if not all(code == 200 for code in warm[kind]):
            res[kind] = {"warm_status": warm[kind]}
            continue

        async def one(c, i, urls=urls):
            rows = []
            for j in range(per_client):
                t = time.perf_counter()
                r = await c.get(urls[(i * per_client + j) % len(urls)])
                rows.append((1000 * (time.perf_counter() - t), server_ms(r), r.status_code))
            return rows

        async def load():
            async with httpx.AsyncClient(base_url=url, timeout=600,
                                         limits=httpx.Limits(max_connections=clients)) as c:
                rs = await asyncio.gather(*(one(c, i) for i in range(clients)))
                return [x for r in rs for x in r]

        w_ms, s_ms, codes = zip(*asyncio.run(load()))
        res[kind] = {"wall": w_ms, "server": s_ms, "codes": codes, "warm_status": warm[kind]}
    return res


def base_load(run: Path, a) -> None:
    """Warm pages under load, the base tree's server then the new one's (module docstring)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_reproduce import check_tree, env_for

    import pyarrow.parquet as pq

    trees = {"base": a.base.resolve(), "new": a.new.resolve()}
    for t in trees.values():
        check_tree(t, sys.executable)
    man = __import__("json").loads((run / "manifest.json").read_text())
    L, D = int(man["model"]["layers"]), int(man["model"]["d_m"])
    trig = pq.read_table(run / "triggers.parquet", columns=["layer", "dim"])
    codes = np.unique(trig.column("layer").to_numpy().astype(np.int64) * D + trig.column("dim").to_numpy())
    rng = random.Random(a.seed)
    mems = [divmod(int(c), D) for c in rng.sample(list(codes), min(a.pages, len(codes)))]
    kinds = {"memory page": [f"/memory/{l}/{d}" for l, d in mems],
             "layer page": [f"/layer/{l}" for l in range(L)],
             "text search": [f"/search?text={w}" for w in TOKENS],
             # from the run's value_index, or the index each server builds in memory on the first
             # token search (503 until then: asked again once the server is idle)
             "token search": [f"/search?token={w}" for w in TOKENS]}
    out(f"run {run}: {trig.num_rows:,} trigger rows, {len(codes):,} mined memories; {a.clients} concurrent "
        f"clients × {a.requests} requests per kind; machine load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    res = {}
    for side, tree in trees.items():
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        t0 = time.perf_counter()
        p = subprocess.Popen([sys.executable, "-m", "ffkv.cli", "serve", str(run), "--port", str(port)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tree,
                             env=env_for(tree))
        try:
            import httpx

            with httpx.Client(timeout=600) as client:
                startup = wait_first_page(client, url, p, t0)
            out(f"{side} ({tree}): first page {startup:.1f} s after start")
            res[side] = load_side(url, p.pid, kinds, a.clients, a.requests)
        finally:
            p.terminate()
            p.wait(10)
        for kind, r in res[side].items():
            if "wall" not in r:
                out(f"  {kind}: not served (status {sorted(set(r['warm_status']))})")
                continue
            out(f"  {kind}: {sum(c == 200 for c in r['codes'])}/{len(r['codes'])} × 200; client wall p50 "
                f"{pct(r['wall'], 50):.0f} ms, p99 {pct(r['wall'], 99):.0f} ms; server p50 {pct(r['server'], 50):.1f} ms, "
                f"p99 {pct(r['server'], 99):.1f} ms")
    out(f"\n{'kind':<14}{'time':<8}{'base p50':>10}{'new p50':>10}{'ratio':>7}{'base p99':>10}{'new p99':>10}{'ratio':>7}  (ms; ratio new/base)")
    for kind in kinds:
        b, n = res["base"][kind], res["new"][kind]
        for k in ("wall", "server"):
            if "wall" not in n:
                out(f"{kind:<14}{k:<8}  new side not served: {sorted(set(n['warm_status']))}")
                continue
            nb = [pct(n[k], 50), pct(n[k], 99)]
            if "wall" not in b:
                out(f"{kind:<14}{k:<8}{'–':>10}{nb[0]:>10.1f}{'–':>7}{'–':>10}{nb[1]:>10.1f}{'–':>7}  (base: not served)")
                continue
            bb = [pct(b[k], 50), pct(b[k], 99)]
            out(f"{kind:<14}{k:<8}{bb[0]:>10.1f}{nb[0]:>10.1f}{nb[0] / bb[0]:>7.2f}{bb[1]:>10.1f}{nb[1]:>10.1f}{nb[1] / bb[1]:>7.2f}")


def colour_times(run: Path, pages: int, seed: int, layers: str | None = None) -> None:
    """Cold and cached 'fully coloured' times of memory pages (module docstring), side by side:
    a server that runs every block below each memory (FFKV_STREAM=off, as before issue 48 item 8)
    and one that starts deep memories from the run's residual stream at mid-depth
    (`ffkv.web.residuals`), each left idle after its first colouring (model, similar memories and
    the stream, computed once per run and stored, then read)."""
    import html as html_mod

    import httpx
    import pyarrow.parquet as pq

    man = __import__("json").loads((run / "manifest.json").read_text())
    D, L = int(man["model"]["d_m"]), int(man["model"]["layers"])
    trig = pq.read_table(run / "triggers.parquet", columns=["layer", "dim"])
    codes = np.unique(trig.column("layer").to_numpy().astype(np.int64) * D + trig.column("dim").to_numpy())
    if layers:  # e.g. 20-29: only memories of these layers (the first, to load the model, from anywhere)
        lo, _, hi = layers.partition("-")
        keep = (codes // D >= int(lo)) & (codes // D <= int(hi or lo))
        first = codes[~keep][:1] if (~keep).any() else codes[:1]
        codes = np.concatenate([first, codes[keep]])
    rng = random.Random(seed)
    mems = [divmod(int(c), D) for c in [codes[0]] + rng.sample(list(codes[1:]), min(pages, len(codes) - 1))]
    sides = {}
    for side, env in (("every block (FFKV_STREAM=off)", {"FFKV_STREAM": "off"}), ("from the stream", {})):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        p, t0 = start(run, port, env)
        rows = {"cold": [], "cached": []}
        try:
            with httpx.Client(base_url=url, timeout=600) as c:
                wait_first_page(c, url, p, t0)
                t = time.perf_counter()
                c.get(f"/api/memory/{mems[0][0]}/{mems[0][1]}/activations")  # loads the model (if not yet)
                out(f"{side}: first colouring (model load included) {time.perf_counter() - t:.1f} s, then "
                    f"{wait_idle(p.pid):.0f} s until the server was idle; machine load average "
                    f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
                for kind in ("cold", "cached"):
                    for l, d in mems[1:]:
                        t = time.perf_counter()
                        page = c.get(f"/memory/{l}/{d}")
                        src = re.search(r'data-act-src="([^"]+)"', page.text)
                        if page.status_code != 200 or not src:
                            raise SystemExit(f"/memory/{l}/{d}: {page.status_code}, colours {'found' if src else 'absent'}")
                        j = c.get(html_mod.unescape(src.group(1))).json()
                        total = time.perf_counter() - t
                        n = sum(len(e["m"]) for e in j["examples"].values())
                        rows[kind].append((total, j["seconds"], j["computed"], n, l))
        finally:
            p.terminate()
            _, err = p.communicate(timeout=10)
        for line in (err or "").splitlines():
            if "residual stream" in line:
                out(f"  server: {line.strip()}")
        sides[side] = rows
        for kind, r in rows.items():
            tot, comp, sents, toks, lay = (np.array(x, dtype=np.float64) for x in zip(*r))
            out(f"  {kind}: {len(r)} memory pages fully coloured in p50 {np.median(tot):.2f} s, max {tot.max():.2f} s "
                f"(goal ≤ 3 s cold; colours computed in p50 {np.median(comp):.2f} s for a median "
                f"{np.median(sents):.0f} sentences, {np.median(toks):.0f} tokens); within 3 s: "
                f"{int((tot <= 3).sum())}/{len(r)}")
            if kind == "cached":
                continue
            for a in range(0, L, 10):  # by depth: a deeper memory's forward runs more blocks
                sel = (lay >= a) & (lay < a + 10)
                if sel.any():
                    out(f"    layers {a}-{min(a + 9, L - 1)}: {int(sel.sum())} pages, p50 {np.median(tot[sel]):.2f} s, "
                        f"max {tot[sel].max():.2f} s, within 3 s: {int((tot[sel] <= 3).sum())}/{int(sel.sum())}")
    (before, after) = (np.array([r[0] for r in x["cold"]]) for x in sides.values())
    out(f"cold pages, from the stream / every block: p50 {np.median(after) / np.median(before):.2f}, "
        f"max {after.max() / before.max():.2f}, per page median {np.median(after / before):.2f}")


def wait_first_page(client, url: str, p, t0: float) -> float:
    import httpx

    while True:
        try:
            r = client.get(url + "/")
            if r.status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        if p.poll() is not None:
            raise SystemExit(f"ffkv serve exited: {p.stderr.read()}")
        time.sleep(0.02)


def main() -> None:
    import httpx

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, default=ROOT / "runs" / "default")
    ap.add_argument("--pages", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--direct", action="store_true", help="time the direct projection of one token too")
    ap.add_argument("--text-load", action="store_true",
                    help="only text search under load: the reference scan, then the text index, side by side")
    ap.add_argument("--clients", type=int, default=20, help="concurrent clients of --text-load and --base")
    ap.add_argument("--text-requests", type=int, default=10, help="searches per client of --text-load")
    ap.add_argument("--base", type=Path, help="warm pages under load: this source tree (has src/ffkv) vs --new")
    ap.add_argument("--new", type=Path, default=ROOT, help="the other tree of --base (default: this checkout)")
    ap.add_argument("--requests", type=int, default=10, help="requests per client and kind of --base")
    ap.add_argument("--colour", action="store_true", help="cold and cached per-token colouring of memory pages")
    ap.add_argument("--layers", help="with --colour: only memories of these layers, e.g. 20-29")
    a = ap.parse_args()
    if not (a.run / "manifest.json").exists():
        raise SystemExit(f"{a.run} is not a run; make one with `ffkv reproduce runs/default` (or pass --run)")
    if a.base:
        base_load(a.run.resolve(), a)
        return
    if a.colour:
        colour_times(a.run.resolve(), a.pages, a.seed, a.layers)
        return
    if a.text_load:
        import pyarrow.parquet as pq

        out(f"run {a.run}: {pq.ParquetFile(a.run / 'triggers.parquet').metadata.num_rows:,} trigger rows, "
            f"{pq.ParquetFile(a.run / 'sentences.parquet').metadata.num_rows:,} sentences; "
            f"machine load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        text_load(a.run, a.clients, a.text_requests)
        return
    import pyarrow.parquet as pq

    n_trig = pq.ParquetFile(a.run / "triggers.parquet").metadata.num_rows
    out(f"run {a.run}: {n_trig:,} trigger rows; value_index table: "
        f"{'yes' if (a.run / 'value_index.parquet').exists() else 'no (the server builds it in memory)'}")

    # ---- startup: command start -> first page ----------------------------------------------------
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    client = httpx.Client(timeout=600)
    p, t0 = start(a.run, port)
    try:
        startup = wait_first_page(client, url, p, t0)
        startup_cpu = cpu_seconds(p.pid)
        t_imp = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import ffkv.cli"], check=True, cwd=ROOT)
        import_s = time.perf_counter() - t_imp
        ov = client.get(url + "/api/overview").json()
        out(f"startup: first page {startup:.2f} s after starting `ffkv serve` (goal ≤ {GOALS['startup_s']:.0f} s; "
            f"{startup_cpu:.2f} s of CPU); tables loaded in {ov['load_seconds']} s; `import ffkv.cli` alone "
            f"takes {import_s:.2f} s here")
        out(f"machine load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")

        # ---- memory pages ------------------------------------------------------------------------
        rng = random.Random(a.seed)
        L, D = ov["layers"], ov["d_m"]
        keys = [(rng.randrange(L), rng.randrange(D)) for _ in range(a.pages)]
        client.get(url + "/memory/0/0")  # compile the template once
        cpu0 = cpu_seconds(p.pid)
        srv, wall, codes = [], [], []
        for l, d in keys:
            t = time.perf_counter()
            r = client.get(f"{url}/memory/{l}/{d}")
            wall.append(1000 * (time.perf_counter() - t))
            srv.append(server_ms(r))
            codes.append(r.status_code)
        cpu_page = 1000 * (cpu_seconds(p.pid) - cpu0) / len(keys)
        ok = sum(c == 200 for c in codes)
        out(f"memory page, server time: {stats(srv)}; goal median ≤ {GOALS['page_median_ms']:.0f} ms, "
            f"p99 ≤ {GOALS['page_p99_ms']:.0f} ms; {ok}/{len(codes)} × 200")
        out(f"memory page, server CPU: {cpu_page:.1f} ms per page (the server process's user+system time / pages)")
        out(f"memory page, client wall time: {stats(wall)}; page size {len(r.content) / 1024:.0f} kB")
        api = [server_ms(client.get(f"{url}/api/memory/{l}/{d}")) for l, d in keys[:100]]
        out(f"memory JSON (/api/memory), server time: {stats(api)}")

        # ---- 50 concurrent pages -----------------------------------------------------------------
        async def burst(n=50):
            async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=n)) as c:
                t = time.perf_counter()
                rs = await asyncio.gather(*(c.get(f"/memory/{l}/{d}") for l, d in keys[:n]))
                return rs, time.perf_counter() - t

        rs, dt = asyncio.run(burst())
        out(f"concurrency: 50 concurrent memory pages: {sum(r.status_code == 200 for r in rs)}/50 × 200 in "
            f"{dt:.2f} s wall (server times {stats([server_ms(r) for r in rs])})")

        # ---- token search ------------------------------------------------------------------------
        t = time.perf_counter()
        client.post(url + "/index/build", headers={"Origin": url}, follow_redirects=False)
        while True:
            st = client.get(url + "/api/index").json()
            if st["status"] in ("ready", "failed"):
                break
            time.sleep(0.5)
        build = time.perf_counter() - t
        if st["status"] == "failed":
            raise SystemExit(f"token index failed: {st['error']}")
        out(f"token index: {st['source']} (k = {st['k']}); ready after {build:.1f} s"
            + (" (includes loading the model)" if st["source"] != "run" else ""))
        tok_ms, totals = [], []
        for q in TOKENS:
            for direction in ("promote", "suppress"):
                r = client.get(url + "/api/search", params={"token": q, "k": 10, "dir": direction})
                tok_ms.append(server_ms(r))
                totals.append(r.json().get("total", 0))
        html_ms = [server_ms(client.get(url + "/search", params={"token": q, "k": 10})) for q in TOKENS]
        out(f"token search over all {L * D:,} values (API): {stats(tok_ms)}; goal ≤ {GOALS['token_ms']:.0f} ms; "
            f"memories found per query: median {np.median(totals):.0f}")
        out(f"token search page (HTML): {stats(html_ms)}")
        text_ms = [server_ms(client.get(url + "/api/search", params={"text": q})) for q in TOKENS[:8]]
        out(f"text search (word in 4.6M-row prefixes): {stats(text_ms)}")
        meas_ms = [server_ms(client.get(url + "/api/search", params={"sort": s}))
                   for s in ("max_prob", "precision", "agreement", "coverage", "max_prob_neg") * 4]
        out(f"search by measure: {stats(meas_ms)}")
    finally:
        p.terminate()
        p.wait(10)

    if a.direct:  # the same answer without an index: project every value onto the vocabulary
        import torch

        from _common import load_default
        from ffkv.model.memories import rank_of

        mm = load_default()
        tok = mm.tok.encode(" the", add_special_tokens=False)[-1]
        t = time.perf_counter()
        n = 0
        with torch.no_grad():
            for l in range(mm.n_layers):
                V = mm.values(l)
                for s in range(0, V.shape[0], 512):
                    z = mm.lens.direction_logits(V[s:s + 512]).float()
                    n += int((rank_of(z, torch.full((len(z),), tok)) < 10).sum())
        direct = time.perf_counter() - t
        out(f"direct projection of all values for one token: {direct:.1f} s ({n} memories rank it < 10), "
            f"{1000 * direct / np.median(tok_ms):,.0f}× the indexed search's median")


if __name__ == "__main__":
    main()
