"""The optional C row parser against the pyarrow path: the same rows (values and dtypes) on the
shared samples and on every edge of the strict format it accepts; everything else it declines,
and the pyarrow path then pads, skips or reports the row as before."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from shared_data import CRITEO

from dlrm_app.data.criteo import fastparse
from dlrm_app.data.criteo.parse import Rows, parse_block

pytestmark = pytest.mark.skipif(
    not fastparse.available() and os.environ.get("CI") != "true",
    reason="the C helper was not built (no compiler); CI must build it")

CATS = ["0000abcd"] * 26


def line(label: str = "1", dense: list[str] | None = None, cats: list[str] | None = None) -> str:
    return "\t".join([label, *(dense or ["1"] * 13), *(cats or CATS)])


def both(buf: bytes, on_bad_row: str = "error") -> tuple[tuple[Rows, int], tuple[Rows, int]]:
    """parse_block with the helper, then without."""
    fast = parse_block(buf, 7, Path("in.tsv"), on_bad_row)
    fastparse.enabled = False
    try:
        slow = parse_block(buf, 7, Path("in.tsv"), on_bad_row)
    finally:
        fastparse.enabled = True
    return fast, slow


def assert_same(a: tuple[Rows, int], b: tuple[Rows, int]) -> None:
    (ra, skipped_a), (rb, skipped_b) = a, b
    assert skipped_a == skipped_b
    for x, y in [(ra.label, rb.label), (ra.dense, rb.dense), (ra.lines, rb.lines),
                 *zip(ra.cats, rb.cats, strict=True)]:
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


@pytest.mark.shared_data(CRITEO)
@pytest.mark.parametrize("name", ["kaggle_head_10k.tsv", "terabyte_day_sample_1k.tsv",
                                  "kaggle_1k_trailing_fields_stripped.tsv"])
def test_samples_parse_the_same(name: str) -> None:
    buf = (CRITEO / name).read_bytes().rstrip(b"\n") + b"\n"  # whole lines, as blocks are
    assert_same(*both(buf))


def test_every_accepted_edge_parses_the_same() -> None:
    rows = [
        line(),
        line("0", ["", "-0", "007", "-12", "9" * 18, "-" + "9" * 18] + [""] * 7,
             ["", "a", "ABCDEF12", "0", "fFfFfFfF", "1234567"] + [""] * 20),
        line(dense=[""] * 13, cats=[""] * 26),  # every field missing
        line(cats=["00000000"] * 25 + [""]),  # an empty last field before the newline
    ]
    buf = ("\n".join(rows) + "\n").encode()
    n = buf.count(b"\n")
    assert fastparse.parse_rows(buf, n) is not None  # all in the strict format
    fast, slow = both(buf)
    assert_same(fast, slow)
    assert fast[0].cats[2][1] == 0xABCDEF12 and fast[0].dense[1][4] == 10 ** 18 - 1


@pytest.mark.parametrize("bad", [
    line("2"), line("+1"), line(dense=["+5"] + ["1"] * 12), line(dense=["-"] + ["1"] * 12),
    line(dense=["1" * 19] + ["1"] * 12), line(cats=["123456789"] + CATS[1:]),
    line(cats=["0000abcg"] + CATS[1:]), line(dense=["1.5"] + ["1"] * 12),
])
def test_values_outside_the_strict_format_are_left_to_the_general_path(bad: str) -> None:
    buf = (line() + "\n" + bad + "\n").encode()
    assert fastparse.parse_rows(buf, 2) is None
    fast, slow = both(buf, "skip")
    assert_same(fast, slow)
    if fast[1]:  # a bad row: reported at its line by either path
        with pytest.raises(ValueError, match=r"in\.tsv:8: "):
            parse_block(buf, 7, Path("in.tsv"), "error")


@pytest.mark.parametrize("text", [
    line()[: line().rindex("\t")],  # a short row (39 fields): padded as missing
    line() + "\t",  # 41 fields
    line().replace("\t", "\t\t", 1),
    line() + "\r",  # CRLF
    "",  # an empty line
])
def test_rows_of_other_shapes_are_left_to_the_general_path(text: str) -> None:
    buf = (line() + "\n" + text + "\n" + line() + "\n").encode()
    assert fastparse.parse_rows(buf, 3) is None
    assert_same(*both(buf, "skip"))


def test_lines_must_all_end_in_a_newline() -> None:
    buf = (line() + "\n" + line()).encode()  # the caller counted 2 lines; the last is cut
    assert fastparse.parse_rows(buf, 2) is None
    assert fastparse.parse_rows(buf + b"\n" + buf + b"\n", 3) is None  # more bytes than lines
