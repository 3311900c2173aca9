"""`python -m bench SUBCOMMAND`: every subcommand reaches its runner's own parser under its
subcommand's name, aliases and unknown names are handled, and the shared options behave alike
in every runner."""

from __future__ import annotations

import argparse
import json

import pytest

from bench import __main__ as entry
from bench import options
from bench.compare import specserve_runner


@pytest.mark.parametrize("name", [*entry.SUBCOMMANDS, *entry.ALIASES])
def test_each_subcommand_answers_help_under_its_name(name, capsys):
    with pytest.raises(SystemExit) as done:
        entry.main([name, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    # default-model's module is edited elsewhere and keeps its module name in --help.
    prog = "python -m bench.default_model" if name == "default-model" else \
        f"{entry.PROG} {entry.ALIASES.get(name, name)}"
    assert out.startswith(f"usage: {prog} ")


def test_the_list_and_the_refusals(capsys):
    assert entry.main([]) == 2
    listing = capsys.readouterr().out
    assert all(f"\n  {name} " in listing for name in [*entry.SUBCOMMANDS, *entry.ALIASES])
    assert entry.main(["--help"]) == 0 and capsys.readouterr().out == listing
    assert entry.main(["bench.compare"]) == 2
    assert "unknown subcommand 'bench.compare'" in capsys.readouterr().err


def test_json_goes_to_stdout_without_a_path_and_to_the_path_with_one(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    options.add_json(parser)
    options.write_json(parser.parse_args([]), {"a": 1})
    assert capsys.readouterr().out == ""
    options.write_json(parser.parse_args(["--json"]), {"a": 1})
    assert json.loads(capsys.readouterr().out) == {"a": 1}
    path = tmp_path / "out.json"
    options.write_json(parser.parse_args(["--json", str(path)]), {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2} and capsys.readouterr().out == ""


def test_the_default_mode_spelling_reaches_generate_as_none():
    seen = []

    class Out:
        token_ids, metrics = [7], {"ttft_s": 0.0, "num_target_steps": 1}

    class Stats:
        def __getattr__(self, name):
            return 0.0

    class FakeLLM:
        class engine:  # noqa: N801 (stands in for LLM.engine)
            stats = Stats()

        def generate(self, prompts, params, speculation):
            seen.append(speculation)
            return [Out()]

    for mode in (options.DEFAULT_MODE, None, "chain:4"):
        specserve_runner(FakeLLM(), mode, max_tokens=1)([1, 2])
    assert seen == [None, None, "chain:4"]
