"""Issue 48 Deliver 7: the report served by `ffkv serve` links its memory ids to their pages (the
file itself keeps plain text, for file://), and says it is out of date once an annotation is saved
or a step finishes after it was built."""
from __future__ import annotations

import os
import re
import shutil
import time

import pytest

from test_web import llama, web_run  # noqa: F401


@pytest.fixture(scope="module")
def served(web_run, tmp_path_factory):  # noqa: F811
    from fastapi.testclient import TestClient

    from ffkv.report import build_report
    from ffkv.web.app import create_app

    run = tmp_path_factory.mktemp("report-links") / "run"
    shutil.copytree(web_run, run, ignore=shutil.ignore_patterns("annotations.sqlite*"))
    index = build_report(run)  # after every step of the run: not out of date
    return run, index, TestClient(create_app(run, log_fn=lambda m: None), base_url="http://127.0.0.1:8000")


def test_memory_ids_link_when_served_and_stay_text_in_the_file(served):
    run, index, client = served
    raw = index.read_text(encoding="utf-8")
    spans = re.findall(r'<span class="mem" data-memory="(\d+)/(\d+)">', raw)
    assert len(spans) >= 10 and "<a class=\"mem\"" not in raw  # Table 2 and the key statistics
    page = client.get("/report/")
    assert page.status_code == 200 and "out of date" not in page.text
    links = re.findall(r'<a class="mem" href="/memory/(\d+)/(\d+)">', page.text)
    assert links == spans and 'class="mem" data-memory' not in page.text
    for layer, dim in sorted(set(links))[:3]:
        assert client.get(f"/memory/{layer}/{dim}").status_code == 200


def test_a_report_older_than_an_annotation_says_so(served):
    run, index, client = served
    time.sleep(0.05)
    t = client.get("/api/search", params={"sort": "layer"}).json()["results"][0]
    body = {"annotator": "r", "sign": 1, "note": "n", "patterns": []}
    assert client.post(f"/api/memory/{t['layer']}/{t['dim']}/annotations", json=body).status_code == 201
    page = client.get("/report/").text
    assert "This report is out of date: annotations were saved after it was built." in page
    assert f"ffkv report {run}" in page
    now = time.time()
    os.utime(index, (now + 5, now + 5))  # rebuilt since: nothing to say
    assert "out of date" not in client.get("/report/").text
