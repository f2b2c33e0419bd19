"""`kvtier bench workload --combine`: a run split into pieces (each short enough for the shared engine lock) gives
the same per-arm figures as the run in one piece. Checked on the committed 2026-12-01 run, cut into the baseline
tier's piece and the rest, through the CLI's own parser."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvtier.bench.workload import main

pytestmark = pytest.mark.unit

RUN = Path(__file__).resolve().parents[2] / "docs" / "results" / "data" / "workload-2026-12-01.json"


def test_pieces_combine_to_the_figures_of_the_whole_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = json.loads(RUN.read_text())
    summ = doc["summary"]
    paths = []
    for name, keep in (("base", lambda a: a == "baseline"), ("rest", lambda a: a != "baseline")):
        piece = {"env": doc["env"], "raw": [r for r in doc["raw"] if keep(r["arm"])],
                 "summary": {**summ, "steps": [s for s in summ["steps"] if keep(s["arm"])]}}
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(piece))
    out = tmp_path / "out"
    assert main(["--combine", *map(str, paths[::-1]), "--out", str(out)]) == 0  # order of pieces does not matter
    assert "per arm against the baseline" in capsys.readouterr().out
    got = json.loads((out / "workload.json").read_text())["summary"]
    assert [p["piece"] for p in got["pieces"]] == ["rest", "base"]
    assert {s["piece"] for s in got["steps"] if s["arm"] == "baseline"} == {"base"}
    whole = {a["arm"]: a for a in summ["arms"]}
    assert {a["arm"] for a in got["arms"]} == {k for k, a in whole.items() if a["ttft_p50_ms"] is not None}
    for a in got["arms"]:
        for k in ("ttft_p50_ms_change", "ttft_p90_ms_change", "return_ttft_p50_ms_change", "req_per_s_sat_change",
                  "busy_s_per_req_change", "short_ttft_p50_ms_change"):
            assert a[k] is not None and math.isclose(a[k], whole[a["arm"]][k]), (a["arm"], k)
    assert (out / "workload.csv").exists() and (out / "workload_load.png").stat().st_size > 0


def test_a_file_that_is_not_a_workload_result_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "x.json"
    bad.write_text('{"hello": 1}')
    assert main(["--combine", str(bad), "--out", str(tmp_path / "out")]) == 2
    assert "not a workload result" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
