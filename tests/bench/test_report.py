"""bench.report: both plots come out of the results file, and the results page carries every
plotted number and command (the plots and the page must not drift apart)."""

from __future__ import annotations

import json
import re

from bench import report

PAGE = report.HERE / "RESULTS.md"


def test_both_plots_are_written(tmp_path, capsys):
    assert report.main(["--out", str(tmp_path)]) == 0
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == ["decode.png", "few_rows.png"]
    for name in written:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().out.split() == [str(tmp_path / n) for n in written]


def test_the_results_page_carries_every_plotted_number_and_command():
    page = PAGE.read_text()
    on_page = {float(n) for n in re.findall(r"(?<![\w.])\d+\.\d+", page)}
    results = json.loads(report.RESULTS.read_text())
    for entry in results["decode"] + results["few_rows"]:
        assert entry["command"] in page, entry["command"]
        values = entry.get("rows") or {
            f"{path} {rows}": ms for path, points in entry["series"].items()
            for rows, ms in points.items()}
        missing = {name: v for name, v in values.items() if v not in on_page}
        assert not missing, f"{entry['date']} {entry['cpu']}: {missing}"
