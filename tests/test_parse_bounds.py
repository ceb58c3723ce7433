"""Numbers a user types are read in one place (`ffkv.parse.parse_int`), bounded in length and
range: a 5,000-digit integer is one line, never Python's int-string ValueError (issue 49)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from conftest import run_cli
from test_cli_errors import one_line_error

from ffkv.errors import FfkvError
from ffkv.parse import MAX_DIGITS, parse_int, parse_interventions, parse_ranges

HUGE = "9" * 5000
WEIRD = st.sampled_from(["", " ", "+", "-", "-0", "+0", "00", "1e3", "1.0", "nan", "NaN", "inf", "-inf", "0x10",
                         "1_000", "٣", "１２", "²", "1 2", "--1", "+-1", HUGE, "-" + HUGE, "0" * 5000 + "7"])


def _reference(t: str):
    """What parse_int must give, computed another way: None for refused."""
    s = t.strip()
    sign, digits = (s[0], s[1:]) if s[:1] in ("+", "-") else ("", s)
    if not digits or any(c not in "0123456789" for c in digits) or len(digits.lstrip("0")) > MAX_DIGITS:
        return None
    v = 0
    for c in digits:
        v = v * 10 + "0123456789".index(c)
    return -v if sign == "-" else v


@settings(max_examples=400, deadline=None)
@given(st.one_of(WEIRD, st.text(max_size=30), st.integers(-10**25, 10**25).map(str),
                 st.builds(lambda a, b: a + b, WEIRD, st.text(alphabet="0123456789+-e. ", max_size=8))))
def test_parse_int_is_the_reference_or_one_line(t):
    want = _reference(t)
    try:
        got = parse_int(t, "--x")
    except FfkvError as e:
        assert want is None, (t, e)
        assert "\n" not in str(e) and len(str(e)) < 200
        return
    assert got == want


@settings(max_examples=200, deadline=None)
@given(st.integers(-50, 50), st.integers(-50, 50), st.integers(-50, 50))
def test_parse_int_range(v, lo, hi):
    ok = lo <= v <= hi
    try:
        assert parse_int(str(v), "--x", lo, hi) == v and ok
    except FfkvError as e:
        assert not ok and str(v) in str(e)


@pytest.mark.parametrize("text", [f"0:{HUGE}", f"{HUGE}:0", f"1:2*{HUGE}", f"1:2={HUGE}", f"0:{'0' * 5000}1x"])
def test_interventions_of_huge_numbers_are_one_short_line(text):
    with pytest.raises(FfkvError) as e:
        parse_interventions(text, 3, 10)
    assert len(str(e.value)) < 300


@pytest.mark.parametrize("text", [HUGE, f"1-{HUGE}", f"-{HUGE}-3", "٣", "1_0"])
def test_ranges_of_huge_or_odd_numbers_are_one_short_line(text):
    with pytest.raises(FfkvError) as e:
        parse_ranges(text, "--layers", 30)
    assert len(str(e.value)) < 300


@pytest.mark.parametrize("flag,value", [("--suppress", f"0:{HUGE}"), ("--suppress", f"{HUGE}:0"),
                                        ("--layer", HUGE)])
def test_cli_huge_integers_are_one_line(tiny_dirs, flag, value):
    if flag == "--layer":
        res = run_cli("show", "/nonexistent-run", "--layer", value)
    else:
        res = run_cli("explain", "hello", "--model", tiny_dirs["gpt2"], flag, value)
    assert len(one_line_error(res)) < 300
