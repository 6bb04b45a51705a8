"""The soak tool (issue 14): a short run checks every result and reports resources."""
import json

import pytest

from leaks import nothing_left_behind  # noqa: F401
from minicomm import cli
from minicomm.tools import soak


@pytest.mark.parametrize("text,seconds", [("10s", 10), ("10m", 600), ("1h", 3600), ("90", 90),
                                          ("0.5s", 0.5)])
def test_parse_duration(text, seconds):
    assert soak.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "10x", "-5s", "0", "abc"])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError, match="--soak"):
        soak.parse_duration(text)


def test_verdict_flags_growth_and_errors():
    row = {"rank": 0, "ops": 5, "wrong": 0, "start": {"rss": 100 << 20, "fds": 10},
           "end": {"rss": 100 << 20, "fds": 10}}
    assert soak.verdict([row])["ok"]
    assert not soak.verdict([dict(row, end={"rss": 100 << 20, "fds": 11})])["ok"]
    assert not soak.verdict([dict(row, end={"rss": 150 << 20, "fds": 10})])["ok"]
    assert soak.verdict([dict(row, end={"rss": 105 << 20, "fds": 10})])["ok"]   # noise
    # a cache that fills in the first half and stays is not growth; growth after it is
    mib = 1 << 20
    filled = [(0, 100 * mib, 10), (10, 160 * mib, 10), (20, 165 * mib, 10), (30, 165 * mib, 10),
              (40, 166 * mib, 10)]
    assert soak.verdict([dict(row, end={"rss": 166 * mib, "fds": 10}, samples=filled)])["ok"]
    leak = [(t, (100 + 3 * t) * mib, 10) for t in range(0, 50, 10)]
    assert not soak.verdict([dict(row, end={"rss": 250 * mib, "fds": 10}, samples=leak)])["ok"]
    assert not soak.verdict([dict(row, wrong=1)])["ok"]


def test_soak_10s_through_the_cli(tmp_path, capsys):
    out = tmp_path / "soak.json"
    rc = cli.main(["bench", "--soak", "10s", "-n", "3", "--json", str(out)])
    text = capsys.readouterr().out
    rep = json.loads(out.read_text())
    assert rep["verdict"]["errors"] == 0, text
    assert rep["verdict"]["ops"] > 0 and len(rep["rows"]) == 3
    for row in rep["rows"]:
        assert row["wrong"] == 0 and row["rounds"] >= 1
        assert row["start"]["rss"] > 0 and row["end"]["fds"] > 0
    assert "verdict" in text and ("PASS" in text) == (rc == 0)
