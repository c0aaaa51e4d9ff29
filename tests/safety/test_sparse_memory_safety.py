"""Every malformed sparse input x every public entry point that hands lengths/offsets/ids to
native code raises a clear ``ValueError``: never a crash, never uninitialized memory.

The cases run in a child process (``sparse_probe_child.py``), so a segfault or an abort is a
failing test naming the case, not a dead test run. Before this check existed the first case
(``lengths=[1, 1, -1, 3]`` for 4 values, key totals adding up) aborted the process in
``permute`` (``munmap_chunk(): invalid pointer``) and the embedding collections returned
uninitialized memory.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import sparse_probe_child as child

REPO = Path(__file__).resolve().parents[2]

# What each malformed input must be told (any entry point; alternatives where an op checks
# its own argument first, e.g. index_select_batch refuses a variable batch before anything).
EXPECTED = {
    "negative_length_totals_match": r"negative length -1 for key 'b' at batch position 0",
    "negative_length": r"negative length -1 for key 'a' at batch position 1",
    "negative_length_int32": r"negative length -1 for key 'b' at batch position 0",
    "decreasing_offsets": r"negative length -2 for key 'a' at batch position 1",
    "offsets_not_from_zero": r"Expected first offset to be 0, but got 1",
    "last_offset_past_values": r"length 6 for key 'b' at batch position 1 is larger than the 4 "
                               r"values|last element of offsets must equal to the number of "
                               r"values, but got 9 and 4",
    "lengths_past_values": r"key 'b' needs values\[2:5\] but values has only 4 entries",
    "huge_lengths_overflow": r"negative length -4611686018427387904 for key 'b' at batch position 1",
    "huge_lengths_wrap_to_zero": r"length 4611686018427387904 for key 'a' at batch position 0 is "
                                 r"larger than the 4 values|lengths sum to 0 and values has 4",
    "lengths_wrong_count": r"(3 lengths|lengths has 3 entries).*2 keys",
    "stride_disagrees": r"lengths has 4 entries but the batch sizes per key \[3, 3\]",
    "length_per_key_lies": r"negative length -1 for key 'b' at batch position 0",
    "length_per_key_wrong": r"length_per_key says key 'a' has 3 values but its lengths sum to 2",
    "offset_per_key_wrong": r"offset_per_key \[0, 1, 4\] does not match the lengths "
                            r"\(expected \[0, 2, 4\]\)",
    "lengths_offsets_disagree": r"offsets is not equal to the cumulative sum of lengths",
    "vbe_strides_disagree": r"stride_per_key_per_rank \(5\) must equal the number of lengths "
                            r"\(4\)|batch sizes per key \[2, 3\].*sum to 5|needs a fixed batch",
    "weights_short": r"weights has 2 entries",
    "weights_short_negative_length": r"negative length -1 for key 'b' at batch position 0",
    "jt_negative_length": r"JaggedTensor: negative length -1 for batch position 1",
    "jt_length_past_values": r"JaggedTensor: length 5 at batch position 2 is larger than the 4 "
                             r"values",
    "jt_decreasing_offsets": r"JaggedTensor: negative length -2 for batch position 1",
    "jt_offsets_past_values": r"JaggedTensor: length 7 at batch position 2 is larger than the 4",
    "jt_huge_lengths": r"JaggedTensor: length 4611686018427387904 at batch position 0 is larger",
    "jt_weights_short": r"JaggedTensor: weights size must equal to values size, but weights has "
                        r"2 entries and values has 4",
    "kt_negative_width": r"KeyedTensor: key 'a' has width -1 in length_per_key",
    "kt_widths_past_values": r"KeyedTensor: values has size 4 along key_dim 1 but length_per_key "
                             r"\[2, 5\] sums to 7",
    "kt_offset_per_key_wrong": r"KeyedTensor: offset_per_key \[0, 3, 4\] does not match "
                               r"length_per_key \(expected \[0, 2, 4\]\)",
}

CASES = [name for name, _ in child.cases()]


def test_every_input_has_an_expectation() -> None:
    assert set(EXPECTED) == set(child.INPUTS) | set(child.JT_INPUTS) | set(child.KT_INPUTS)
    assert len(CASES) == (len(child.INPUTS) * (len(child.OPS) + len(child.MODULES))
                          + len(child.JT_INPUTS) * len(child.JT_OPS)
                          + len(child.KT_INPUTS) * len(child.KT_OPS))


@pytest.fixture(scope="module")
def outcomes() -> dict[str, dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, str(Path(child.__file__))], capture_output=True, text=True,
        env=env, cwd=REPO, timeout=600,
    )
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    started = [r["start"] for r in rows if "start" in r]
    done = {r["case"]: r for r in rows if "case" in r}
    if proc.returncode != 0:
        died = started[-1] if len(started) > len(done) else "(after the last case)"
        pytest.fail(f"the probe process died (exit {proc.returncode}) in case {died}: "
                    f"{proc.stderr[-2000:]}")
    return done


@pytest.mark.parametrize("case", CASES)
def test_malformed_input_is_refused_clearly(outcomes: dict[str, dict], case: str) -> None:
    outcome = outcomes[case]
    assert "error" in outcome, f"{case} returned {outcome.get('result')} instead of an error"
    assert outcome["error"] == "ValueError", outcome
    assert re.search(EXPECTED[case.split("/")[0]], outcome["message"]), outcome["message"]
