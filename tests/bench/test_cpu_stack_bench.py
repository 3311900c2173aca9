"""bench peer --cpu-stack's switch: each run sees its own SPECSERVE_CPU_STACK, and the caller's
setting comes back afterwards, even when the run raises; a setting other than 1 or 0 is refused
before anything loads."""

from __future__ import annotations

import os

import pytest

from bench.cpu_paths import main, with_stack


def test_each_run_sees_its_setting_and_the_callers_comes_back(monkeypatch):
    seen = []
    monkeypatch.setenv("SPECSERVE_CPU_STACK", "1")
    with_stack(lambda p: seen.append((p, os.environ["SPECSERVE_CPU_STACK"])), "0")("a")
    assert seen == [("a", "0")] and os.environ["SPECSERVE_CPU_STACK"] == "1"
    monkeypatch.delenv("SPECSERVE_CPU_STACK")

    def fails(prompt):
        assert os.environ["SPECSERVE_CPU_STACK"] == "0"
        raise RuntimeError(prompt)

    with pytest.raises(RuntimeError, match="b"):
        with_stack(fails, "0")("b")
    assert "SPECSERVE_CPU_STACK" not in os.environ


def test_a_setting_other_than_1_or_0_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--cpu-stack", "1,2"])
    assert "expected a comma list of 1 and 0" in capsys.readouterr().err
