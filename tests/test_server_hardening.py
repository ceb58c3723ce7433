"""The browser's server under hostile or unusual input (issue 27 items 5, 6, 9; issue 26's
annotation bugs): any Unicode annotator name saved once, JSON nesting bounded, one set of
annotation limits for the form, the API and `ffkv annotate`, binding beyond loopback only with
--allow-remote and an access token, Post/Redirect/Get and drafts for the annotation form, and
statistics that do not re-read the pattern tables on every request.

The server runs on a copy of `test_web`'s run (its own annotations.sqlite), through TestClient;
nothing here listens beyond loopback (the CLI's refusals happen before it binds)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest

from conftest import free_port, serving
from test_web import llama, web_run  # noqa: F401  (fixtures)

HOST = "http://127.0.0.1:8000"
ORIGIN = {"Origin": HOST}
from conftest import CHROMIUM


@pytest.fixture(scope="module")
def hrun(web_run, tmp_path_factory):  # noqa: F811
    run = tmp_path_factory.mktemp("hardening") / "run"
    shutil.copytree(web_run, run, ignore=shutil.ignore_patterns("annotations.sqlite*"))
    return run


@pytest.fixture(scope="module")
def app(hrun):
    from ffkv.web.app import create_app

    return create_app(hrun, log_fn=lambda m: None)


@pytest.fixture
def client(app):
    from fastapi.testclient import TestClient

    return TestClient(app, base_url=HOST, raise_server_exceptions=False)


def store(run):
    from ffkv.store.annotations import AnnotationStore

    return AnnotationStore(run)


def form(annotator, desc="dates", kind="shallow", prefixes=(0, 1, 2), note="", sign=1):
    return {"annotator": annotator, "sign": str(sign), "note": note, "p0_description": desc, "p0_kind": kind,
            "p0_prefixes": [str(i) for i in prefixes], "p1_description": "", "p2_description": ""}


def one_line(text: str) -> None:
    assert "Traceback" not in text and len(text.strip().splitlines()) == 1, text


# ---- item 5: no 500 for a client's input -------------------------------------------------------------
@pytest.mark.parametrize("name", ["Łukasz", "李明", "Zoë 🙂 \"quoted\"; a=b, c", "%41 not an escape"])
def test_any_unicode_annotator_is_saved_once_and_remembered(client, hrun, name):
    r = client.post("/memory/2/11/annotate", data=form(name), headers=ORIGIN, follow_redirects=False)
    assert r.status_code == 303, r.text[:300]
    cookie = r.headers["set-cookie"]
    assert cookie.isascii() and "httponly" in cookie.lower() and "samesite=strict" in cookie.lower()
    value = re.match(r"ffkv_annotator=([^;]*)", cookie).group(1)
    assert unquote(value) == name
    recs = [a for a in store(hrun).list(layer=2, dim=11) if a["annotator"] == name]
    assert len(recs) == 1 and recs[0]["patterns"][0]["description"] == "dates"
    page = client.get(r.headers["location"]).text  # the client sends the cookie back
    assert re.search(r'name="annotator" value="([^"]*)"', page).group(1) == \
        name.replace("&", "&amp;").replace('"', "&#34;")


def test_deeply_nested_json_is_refused_not_a_500(client, hrun):
    before = store(hrun).count()
    n = 100_000  # 200 KB, under the body cap
    for body in ("[" * n + "]" * n, '{"annotator": "deep", "patterns": ' + "[" * n + "]" * n + "}",
                 '{"annotator": "deep", "note": ' + "{\"a\": " * 5000 + "1" + "}" * 5000 + "}"):
        r = client.post("/api/memory/1/5/annotations", content=body.encode(),
                        headers={**ORIGIN, "Content-Type": "application/json"})
        assert r.status_code in (400, 413, 422), (r.status_code, r.text[:200])
        detail = r.json()["detail"]
        assert "\n" not in detail and ("deeper" in detail or "nest" in detail), detail
    # brackets inside strings do not count
    r = client.post("/api/memory/1/5/annotations", headers=ORIGIN,
                    json={"annotator": "brackets", "note": "[" * 2000 + "{" * 2000,
                          "patterns": [{"description": "]]]}}}", "kind": "shallow", "prefixes": [0]}]})
    assert r.status_code == 201, r.text[:300]
    assert store(hrun).count() == before + 1


# ---- item 9: one limit per thing --------------------------------------------------------------------
def test_one_set_of_annotation_limits_for_form_api_and_cli(client, hrun, tmp_path):
    from test_mutate import cli_inproc

    from ffkv.store.annotations import MAX_DESCRIPTION, MAX_NAME, MAX_NOTE, MAX_PATTERNS, MAX_RECORD_BYTES

    st = store(hrun)
    before = st.export()
    page = client.get("/memory/1/5").text  # the form says the same limits
    assert f'name="annotator" value="" required maxlength="{MAX_NAME}"' in page
    assert f'maxlength="{MAX_NOTE}"' in page and f'maxlength="{MAX_DESCRIPTION}"' in page
    pat = [{"description": "d", "kind": "shallow", "prefixes": [0]}]
    over = [({"note": "n" * (MAX_NOTE + 1)}, "note"), ({"annotator": "a" * (MAX_NAME + 1)}, "annotator"),
            ({"patterns": [{"description": "d" * (MAX_DESCRIPTION + 1), "kind": "shallow", "prefixes": [0]}]},
             "description"),
            ({"patterns": pat * (MAX_PATTERNS + 1)}, "patterns")]
    for change, needle in over:
        rec = {"annotator": "limits", "note": "", "patterns": pat, **change}
        # the JSON API
        r = client.post("/api/memory/1/5/annotations", headers=ORIGIN, json=rec)
        assert r.status_code == 422 and needle in r.json()["detail"], (needle, r.text[:200])
        # the form
        f = form(rec["annotator"], desc=rec["patterns"][0]["description"], prefixes=(0,), note=rec["note"])
        for j in range(1, len(rec["patterns"])):
            f |= {f"p{j}_description": "d", f"p{j}_kind": "shallow", f"p{j}_prefixes": ["0"]}
        r = client.post("/memory/1/5/annotate", headers=ORIGIN, data=f)
        if needle == "patterns":  # the form has no slot past the last: its fields are not read
            assert r.status_code in (303, 200, 422)
            st.delete("limits", 1, 5)
        else:
            assert r.status_code == 422 and needle in r.text, (needle, r.status_code)
        # ffkv annotate import
        line = json.dumps({"layer": 1, "dim": 5, **rec})
        (tmp_path / "a.jsonl").write_text(line + "\n")
        code, out, err = cli_inproc("annotate", "import", hrun, tmp_path / "a.jsonl")
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, (needle, err)
    code, out, err = cli_inproc("annotate", "add", hrun, "-a", "limits", "-l", 1, "-d", 5, "--note",
                                "n" * (MAX_NOTE + 1))
    assert code == 2 and "note" in err and len(err.strip().splitlines()) == 1, err
    # one annotation's size: the web's body and an import's line
    big = {"annotator": "limits", "layer": 1, "dim": 5, "note": "", "patterns": pat, "x": "y" * MAX_RECORD_BYTES}
    (tmp_path / "big.jsonl").write_text(json.dumps(big) + "\n")
    code, out, err = cli_inproc("annotate", "import", hrun, tmp_path / "big.jsonl")
    assert code == 2 and f"{MAX_RECORD_BYTES:,}" in err and len(err.strip().splitlines()) == 1, err
    r = client.post("/api/memory/1/5/annotations", headers=ORIGIN, content=json.dumps(big).encode())
    assert r.status_code == 413
    r = client.post("/memory/1/5/annotate", headers=ORIGIN, data=form("limits", note="n" * MAX_RECORD_BYTES))
    assert r.status_code == 413
    assert st.export() == before  # nothing was written
    # at the limits exactly: saved everywhere
    ok = {"annotator": "a" * MAX_NAME, "note": "n" * MAX_NOTE, "patterns": pat * MAX_PATTERNS}
    assert client.post("/api/memory/1/5/annotations", headers=ORIGIN, json=ok).status_code == 201


# ---- item 6: beyond loopback only on purpose, with a token -------------------------------------------
def cli_proc(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "ffkv.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def test_serve_beyond_loopback_needs_allow_remote(hrun):
    for host in ("0.0.0.0", "10.255.255.1", "::"):
        p = cli_proc("serve", hrun, "--host", host, "--port", free_port())
        assert p.returncode == 2 and "--allow-remote" in p.stderr, p.stderr
        one_line(p.stderr)
    p = cli_proc("serve", hrun, "--allowed-host", "x.example", "--port", free_port())
    assert p.returncode == 2 and "--allowed-host" in p.stderr
    one_line(p.stderr)


def test_serve_names_the_host_when_it_cannot_be_bound(hrun):
    """10.255.255.1 is not an address of this machine: the host is the problem, not the port."""
    p = cli_proc("serve", hrun, "--host", "10.255.255.1", "--allow-remote", "--port", free_port())
    assert p.returncode == 2, p.stderr
    one_line(p.stderr)
    assert "--host 10.255.255.1" in p.stderr and "another --port" not in p.stderr, p.stderr
    p = cli_proc("serve", hrun, "--host", "no-such-host.invalid", "--allow-remote", "--port", free_port())
    assert p.returncode == 2 and "--host no-such-host.invalid" in p.stderr, p.stderr
    one_line(p.stderr)


@pytest.fixture(scope="module")
def remote_app(hrun):
    from ffkv.web.app import LOOPBACK_NAMES, create_app

    return create_app(hrun, host="0.0.0.0", allowed_hosts=["ffkv.lan", *LOOPBACK_NAMES], token="s3cret-token",
                      log_fn=lambda m: None)


def test_remote_server_needs_its_token_for_every_read_and_write(remote_app, hrun):
    from fastapi.testclient import TestClient

    from ffkv.web.app import token_cookie_name

    base = "http://ffkv.lan:8000"
    c = TestClient(remote_app, base_url=base, raise_server_exceptions=False)
    post = {"annotator": "remote", "patterns": [{"description": "d", "kind": "shallow", "prefixes": [0]}]}
    for method, url in (("GET", "/"), ("GET", "/static/style.css"), ("GET", "/api/overview"),
                        ("GET", "/memory/1/5"), ("GET", "/annotations"), ("GET", "/?token=wrong"),
                        ("POST", "/api/memory/1/5/annotations")):
        r = c.request(method, url, headers={"Origin": base}, json=post if method == "POST" else None)
        assert r.status_code in (401, 403), (method, url, r.status_code)
        one_line(r.text)
    r = c.get("/api/overview", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    assert store(hrun).get("remote", 1, 5) is None
    # the bearer token
    r = c.get("/api/overview", headers={"Authorization": "Bearer s3cret-token"})
    assert r.status_code == 200 and r.json()["rows"]
    # the printed URL: ?token= once, then a cookie (HttpOnly, SameSite=Strict)
    r = c.get("/memory/1/5?top=5&token=s3cret-token", follow_redirects=False)
    assert r.status_code == 200 and "Human annotations" in r.text
    cookie = r.headers["set-cookie"]
    assert cookie.startswith(token_cookie_name("s3cret-token") + "=s3cret-token")
    assert "httponly" in cookie.lower() and "samesite=strict" in cookie.lower()
    r = c.get("/memory/1/5?top=5")
    assert r.status_code == 200 and "Human annotations" in r.text
    r = c.post("/api/memory/1/5/annotations", headers={"Origin": base}, json=post)
    assert r.status_code == 201 and store(hrun).get("remote", 1, 5) is not None
    # DNS rebinding: evil.example resolving to this server, even holding the token
    for headers in ({"Host": "evil.example", "Origin": "http://evil.example"},
                    {"Host": "evil.example", "Origin": "http://evil.example", "Authorization": "Bearer s3cret-token"}):
        r = c.post("/api/memory/1/6/annotations", headers=headers, json={**post, "annotator": "evil"})
        assert r.status_code == 400, r.status_code
    assert store(hrun).get("evil", 1, 6) is None


def test_remote_app_refuses_wildcards_and_no_token(hrun):
    from ffkv.errors import FfkvError
    from ffkv.web.app import allowed_hosts_for, create_app

    assert "*" not in allowed_hosts_for("0.0.0.0")
    with pytest.raises(FfkvError, match="token"):
        create_app(hrun, host="0.0.0.0", log_fn=lambda m: None)
    with pytest.raises(FfkvError, match="wildcard"):
        create_app(hrun, host="0.0.0.0", token="t", allowed_hosts=["*"], log_fn=lambda m: None)
    # the default on a wildcard bind: loopback names only (the evil Host is refused)
    from fastapi.testclient import TestClient

    c = TestClient(create_app(hrun, host="0.0.0.0", token="t", log_fn=lambda m: None), base_url=HOST)
    r = c.post("/api/memory/1/6/annotations", headers={"Host": "evil.example", "Origin": "http://evil.example",
                                                         "Authorization": "Bearer t"},
               json={"annotator": "evil2", "patterns": []})
    assert r.status_code == 400 and store(hrun).get("evil2", 1, 6) is None


def test_loopback_needs_no_token(client):
    assert client.get("/").status_code == 200 and client.get("/api/overview").status_code == 200


# ---- issue 26: the annotation form --------------------------------------------------------------------
def test_a_refused_form_says_why_keeps_the_input_and_reloads_without_posting(client, hrun):
    st = store(hrun)
    f = form("draftee", desc="place names", kind="", prefixes=(1, 4), note="my note")
    r = client.post("/memory/2/12/annotate", data=f, headers=ORIGIN)
    assert r.status_code == 422
    msg = re.search(r'<p class="form-error"[^>]*>(.*?)</p>', r.text, re.S).group(1)
    assert "None" not in msg and "S1" in msg and "kind must be shallow or semantic" in msg, msg
    assert 'value="place names"' in r.text and "my note" in r.text
    assert re.search(r'name="p0_prefixes" value="4"[^>]*checked', r.text)
    draft = re.search(r'data-draft-url="([^"]+)"', r.text).group(1).replace("&amp;", "&")
    assert st.get("draftee", 2, 12) is None
    # the URL app.js puts in place of the POST: a GET that shows the form as typed, and the reason
    r = client.get(draft)
    assert r.status_code == 200 and 'value="place names"' in r.text and "kind must be shallow or semantic" in r.text
    assert re.search(r'name="p0_prefixes" value="4"[^>]*checked', r.text)
    assert st.get("draftee", 2, 12) is None
    # another memory's page ignores the draft
    assert 'value="place names"' not in client.get(draft.replace("/memory/2/12", "/memory/2/13")).text
    # the JSON API names a missing kind too
    r = client.post("/api/memory/2/12/annotations", headers=ORIGIN,
                    json={"annotator": "draftee", "patterns": [{"description": "x", "prefixes": [0]}]})
    assert r.status_code == 422 and "None" not in r.json()["detail"] and "none given" in r.json()["detail"]
    # a description without ticks, ticks without a description: named by slot
    r = client.post("/memory/2/12/annotate", headers=ORIGIN,
                    data=form("draftee", desc="", prefixes=(2,)) | {"p1_description": "x", "p1_kind": "semantic"})
    msg = re.search(r'<p class="form-error"[^>]*>(.*?)</p>', r.text, re.S).group(1)
    assert r.status_code == 422 and "S1" in msg and "no description" in msg, msg
    r = client.post("/memory/2/12/annotate", headers=ORIGIN,
                    data=form("draftee", prefixes=()) | {"p0_kind": "semantic"})
    assert r.status_code == 422 and "tick the prefixes" in r.text
    # success: Post/Redirect/Get
    r = client.post("/memory/2/12/annotate", data=form("draftee"), headers=ORIGIN, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"].startswith("/memory/2/12?")
    assert st.get("draftee", 2, 12)["patterns"][0]["description"] == "dates"


def test_more_slots_without_javascript_keeps_the_typed_form(client):
    """The "more pattern slots" button without app.js: a GET of the form as typed."""
    page = client.get("/memory/1/5").text
    button = re.search(r'<button[^>]*id="more-slots"[^>]*>', page).group(0)
    assert 'formmethod="get"' in button and 'name="slots"' in button
    assert page.index(">Save annotation<") < page.index('id="more-slots"')  # Enter in a field saves
    r = client.get("/memory/1/5", params={"annotate_sign": "1", "sign": "1", "annotator": "Łukasz", "note": "n1",
                                         "p0_description": "years", "p0_kind": "semantic", "p0_prefixes": ["1", "3"],
                                         "p1_description": "", "p2_description": "", "slots": "6"})
    assert r.status_code == 200
    assert 'value="Łukasz"' in r.text and 'value="years"' in r.text and "n1</textarea>" in r.text
    assert re.search(r'name="p0_kind" value="semantic" checked', r.text)
    assert re.search(r'name="p0_prefixes" value="3"[^>]*checked', r.text)
    assert len(re.findall(r'<fieldset class="slot">', r.text)) == 6


def test_annotations_page_counts_in_words(app, hrun):
    """'1 annotations … of 1 keys' and an internal method's name, before."""
    import tempfile

    from fastapi.testclient import TestClient

    from ffkv.web.app import create_app

    with tempfile.TemporaryDirectory() as d:
        run = Path(d) / "run"
        shutil.copytree(hrun, run, ignore=shutil.ignore_patterns("annotations.sqlite*"))
        c = TestClient(create_app(run, log_fn=lambda m: None), base_url=HOST)
        assert "No annotations yet" in c.get("/annotations").text
        c.post("/memory/1/5/annotate", data=form("solo"), headers=ORIGIN)
        text = " ".join(re.sub(r"<[^>]+>", " ", c.get("/annotations").text).split())
        assert "1 annotation by 1 annotator of 1 memory." in text, text[:500]
        assert "AnnotationStore" not in text and "stats()" not in text
        c.post("/memory/1/5/annotate", data=form("duo", sign=-1), headers=ORIGIN)
        c.post("/memory/1/6/annotate", data=form("duo"), headers=ORIGIN)
        text = " ".join(re.sub(r"<[^>]+>", " ", c.get("/annotations").text).split())
        assert "3 annotations by 2 annotators of 2 memories (3 lists" in text, text[:500]


def test_annotation_statistics_read_the_pattern_tables_once(hrun, monkeypatch):
    """/annotations and /api/annotations took seconds once an annotation existed: every request
    read the pattern tables again. Now once per version of each table."""
    import os
    import tempfile

    from fastapi.testclient import TestClient

    from ffkv.store.run import Run
    from ffkv.web.app import create_app

    reads: list[str] = []
    real = Run.read_table

    def counting(self, name, *a, **kw):
        if sys._getframe(1).f_code.co_filename.endswith("annotations.py"):  # not the page's own warm-up
            reads.append(name)
        return real(self, name, *a, **kw)

    monkeypatch.setattr(Run, "read_table", counting)
    with tempfile.TemporaryDirectory() as d:
        run = Path(d) / "run"
        shutil.copytree(hrun, run, ignore=shutil.ignore_patterns("annotations.sqlite*"))
        assert (run / "patterns.parquet").exists() and (run / "pattern_keys.parquet").exists()
        c = TestClient(create_app(run, log_fn=lambda m: None), base_url=HOST)
        assert c.post("/memory/1/5/annotate", data=form("reader"), headers=ORIGIN).status_code == 200
        want = c.get("/api/annotations").json()
        assert want["stats"]["auto_vs_human"] is not None
        reads.clear()
        for _ in range(5):
            assert c.get("/annotations").status_code == 200
            assert c.get("/api/annotations").json() == want
        assert reads.count("patterns") == 0 and reads.count("pattern_keys") == 0 and reads.count("triggers") == 0, reads
        # a new version of a table (ffkv patterns again) is read again, once
        t = real(Run(run), "patterns")
        w = Run(run)
        w.write_table("patterns", t)
        w.save()  # its record: a reader trusts only what the manifest records
        os.utime(run / "patterns.parquet", ns=(1, 1))  # even with an older mtime: the file changed
        for _ in range(3):
            c.get("/api/annotations")
        assert reads.count("patterns") == 1 and reads.count("pattern_keys") == 0, reads


# ---- the form in a browser ------------------------------------------------------------------------------
@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium")
def test_more_slots_keeps_what_was_typed_in_a_browser(app, hrun):
    from playwright.sync_api import sync_playwright

    from ffkv.report.screenshot import BROWSER_ARGS

    st = store(hrun)
    with serving(app) as url, sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=BROWSER_ARGS)
        try:
            for js in (True, False):
                name = "browser-js" if js else "browser-nojs"
                page = b.new_context(java_script_enabled=js).new_page()
                posts = []
                page.on("request", lambda r: posts.append(r.url) if r.method == "POST" else None)
                page.goto(url + "/memory/0/7#annotations")
                page.fill("input[name=annotator]", name)
                page.fill("input[name=p0_description]", "first pattern")
                page.check("input[name=p0_kind][value=semantic]")
                page.check("input[name=p0_prefixes][value='1']")
                page.check("input[name=p0_prefixes][value='2']")
                page.fill("textarea[name=note]", "typed note")
                n = page.locator("fieldset.slot").count()
                page.click("#more-slots")
                page.wait_for_load_state()
                assert page.locator("fieldset.slot").count() == n + 3
                assert page.locator("table.matrix thead th.pcol").count() == n + 3
                assert page.input_value("input[name=annotator]") == name
                assert page.input_value("input[name=p0_description]") == "first pattern"
                assert page.is_checked("input[name=p0_kind][value=semantic]")
                assert page.is_checked("input[name=p0_prefixes][value='1']")
                assert page.is_checked("input[name=p0_prefixes][value='2']")
                assert not page.is_checked("input[name=p0_prefixes][value='3']")
                assert page.input_value("textarea[name=note]") == "typed note"
                # the new last slot works: type, tick, save
                j = n + 2
                page.fill(f"input[name=p{j}_description]", "last pattern")
                page.check(f"input[name=p{j}_kind][value=shallow]")
                page.check(f"input[name=p{j}_prefixes][value='0']")
                page.click("#annotate-form button[type=submit]:not(#more-slots)")
                page.wait_for_load_state()
                assert posts, "the form was not posted"
                rec = st.get(name, 0, 7)
                assert rec is not None and rec["note"] == "typed note", rec
                assert rec["patterns"] == [
                    {"description": "first pattern", "kind": "semantic", "prefixes": [1, 2]},
                    {"description": "last pattern", "kind": "shallow", "prefixes": [0]}]
                if js:  # a refused save: the message, the input, and a reload that does not post
                    j = 1  # the page after saving shows the two saved patterns first
                    assert page.input_value(f"input[name=p{j}_description]") == "last pattern"
                    page.fill("input[name=p0_description]", "changed")
                    page.check(f"input[name=p{j}_prefixes][value='3']")
                    page.evaluate("document.querySelectorAll('input[name=p0_kind]')"
                                  ".forEach(function (x) { x.checked = false; })")
                    page.click("#annotate-form button[type=submit]:not(#more-slots)")
                    page.wait_for_load_state()
                    assert "kind must be shallow or semantic" in page.locator(".form-error").inner_text()
                    assert "draft=" in page.url
                    posts.clear()
                    page.reload()
                    assert posts == [], "reloading posted the form again"
                    assert page.input_value("input[name=p0_description]") == "changed"
                    assert page.is_checked(f"input[name=p{j}_prefixes][value='3']")
                    assert "kind must be shallow or semantic" in page.locator(".form-error").inner_text()
                    assert st.get(name, 0, 7) == rec
                page.context.close()
        finally:
            b.close()


@pytest.mark.parametrize("preset", [None, "ACTIVE"])
def test_serve_lets_openmp_workers_sleep_before_torch_loads(hrun, preset):
    """`ffkv serve` sets OMP_WAIT_POLICY=PASSIVE (unless the environment names a policy) before
    anything imports torch, whose OpenMP reads it once: spinning workers made a page's colours 3×
    slower on a busy machine. Checked in a process of its own, when the app is being made."""
    import os

    code = ("import os, sys\n"
            "import ffkv.web.app as a\n"
            "def stop(*args, **kw):\n"
            "    print('policy', os.environ.get('OMP_WAIT_POLICY'), 'torch', 'torch' in sys.modules)\n"
            "    raise SystemExit(0)\n"
            "a.create_app = stop\n"
            "from ffkv.cli import main\n"
            "sys.argv = ['ffkv', 'serve', sys.argv[1], '--port', '0']\n"
            "main()\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if preset:
        env["OMP_WAIT_POLICY"] = preset
    p = subprocess.run([sys.executable, "-c", code, str(hrun)], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"policy {preset or 'PASSIVE'} torch False" in p.stdout, (p.stdout, p.stderr[-2000:])
