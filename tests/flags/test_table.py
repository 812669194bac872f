"""The flag tables: what they register, read back and write as argv again; and every
command's parser, built from them, answers --help with each option once."""

from __future__ import annotations

import argparse
import contextlib
import io
from pathlib import Path

import pytest

from tandem.cli.main import build_parser, main
from tandem.flags.engine import ENGINE_FLAGS, engine_argv
from tandem.flags.table import Command, Flag, FlagTable, check_args
from tandem.launch.up_flags import check_up
from tandem.router.placement.flags import POLICY_FLAGS, UP_POLICY_FLAGS

TABLE = FlagTable("demo", (
    Flag("--size", "how big", 3, type=int, metavar="N"),
    Flag("--name", "what to call it"),
    Flag("--fast", "hurry", switch=True),
    Flag("--slow", "dawdle", action="store_false", dest_name="hurried"),
    Flag("--tag", "repeatable", [], action="append"),
    Flag("--words", "several", nargs="+"),
    Flag("--prompt", "short and long", action="append", short="-p"),
))


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    TABLE.add_to(parser)
    return parser.parse_args(list(argv))


def test_a_table_registers_its_flags_in_one_group_with_their_defaults() -> None:
    parser = argparse.ArgumentParser()
    group = TABLE.add_to(parser)
    assert group.title == "demo"
    assert [a.dest for a in group._group_actions] == [f.dest for f in TABLE]
    assert vars(_parse()) == TABLE.defaults() == {
        "size": 3, "name": None, "fast": False, "hurried": True, "tag": [], "words": None,
        "prompt": None,
    }


def test_values_read_back_as_argv_parse_to_the_same_values() -> None:
    argv = ["--size", "7", "--fast", "--slow", "--tag", "a", "--tag", "b", "--words", "x", "y",
            "-p", "hi"]
    args = _parse(*argv)
    again = TABLE.argv(args)
    assert vars(_parse(*again)) == vars(args)
    assert TABLE.argv(_parse()) == []  # nothing differs from its default
    assert TABLE.argv(_parse(), changed_only=False) == ["--size", "3"]
    assert "--size" not in TABLE.argv(args, exclude={"--size"})


def test_an_appended_default_list_is_not_shared_between_parsers() -> None:
    first = _parse("--tag", "a")
    second = _parse()
    assert first.tag == ["a"] and second.tag == []


def test_a_subset_keeps_the_table_order_and_refuses_unknown_options() -> None:
    assert [f.option for f in TABLE.subset({"--fast", "--size"})] == ["--size", "--fast"]
    assert [f.option for f in TABLE.without({"--size"})][0] == "--name"
    with pytest.raises(KeyError):
        TABLE.subset({"--nope"})
    # tandem up offers part of the router's policy table, never a flag of its own
    assert {f.option for f in UP_POLICY_FLAGS} < {f.option for f in POLICY_FLAGS}


def test_engine_argv_is_the_engine_table_written_back() -> None:
    args = build_parser().parse_args(["serve", "--block-size", "32", "--enforce-eager"])
    assert engine_argv(args) == ["--enforce-eager", "--block-size", "32"]
    assert engine_argv(args, exclude={"--block-size"}) == ["--enforce-eager"]
    assert ENGINE_FLAGS["--block-size"].default is None  # the device's: 64 on a CPU, 16 on a GPU


def test_a_command_check_runs_after_the_parse() -> None:
    seen = []
    parser = argparse.ArgumentParser()
    Command(lambda args: 0, seen.append).install(parser)
    args = parser.parse_args([])
    check_args(args)
    assert seen == [args]


def _subparsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):  # noqa: ANN202
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subparsers(sub, (*path, name))


def test_every_command_answers_help_and_lists_each_option_once() -> None:
    commands = list(_subparsers(build_parser()))
    assert len(commands) > 20
    for path, parser in commands:
        options = [o for a in parser._actions for o in a.option_strings]
        assert len(options) == len(set(options)), path
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
            build_parser().parse_args([*path, "--help"])
        assert exit_.value.code == 0 and "usage: tandem" in out.getvalue(), path


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tandem: error: "), lines
    return lines[0]


def test_bad_combinations_are_one_parse_error_before_anything_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_CLUSTER_SECRET", raising=False)
    ledger = ["--ledger", str(tmp_path / "usage.sqlite3")]
    assert "--workers must be >= 1" in _error(["up", "--workers", "0", *ledger], capsys)
    assert "--migration-limit must be >= 0" in _error(["up", "--migration-limit", "-1", *ledger],
                                                      capsys)
    assert "--netns does not reach a --kv-store" in _error(
        ["up", "--netns", "--kv-store", "redis", *ledger], capsys)
    assert "give workers" in _error(["route", *ledger], capsys)
    assert "--role prefill needs the cluster secret" in _error(
        ["serve", "--role", "prefill", "--device", "cpu"], capsys)
    assert "unknown device 'lots'" in _error(["plan", "memory", "x", "--devices", "lots"], capsys)


def test_check_up_accepts_the_defaults(tmp_path: Path) -> None:
    args = build_parser().parse_args(["up", "--ledger", str(tmp_path / "usage.sqlite3")])
    check_up(args)
