"""`tandem bench chaos`'s pure parts: the fault schedule, the prompts, the report."""

from __future__ import annotations

import pytest

from tandem.bench.chaos import PhaseResult, _p99, parse_faults, prompts, report
from tandem.cli.main import main


def test_fault_schedule_is_parsed_and_sorted() -> None:
    faults = parse_faults("30:prefill-0, 10:decode-0")
    assert [(f.at, f.worker) for f in faults] == [(10.0, "decode-0"), (30.0, "prefill-0")]
    with pytest.raises(ValueError, match="S:WORKER"):
        parse_faults("10")


def test_cut_faults_name_a_worker_and_a_duration() -> None:
    kill, cut = parse_faults("25:cut:decode-1:10,10:decode-0")
    assert (kill.kind, kill.worker, kill.cut_s) == ("kill", "decode-0", None)
    assert (cut.at, cut.kind, cut.worker, cut.cut_s) == (25.0, "cut", "decode-1", 10.0)
    assert cut.describe() == "cut decode-1 for 10 s"
    for bad in ("5:cut:decode-1", "5:cut::3", "5:snip:decode-1:3", "x:decode-0"):
        with pytest.raises(ValueError, match="S:cut:WORKER:D"):
            parse_faults(bad)


def test_half_the_prompts_are_long_enough_to_split() -> None:
    conversations = prompts(4)
    lengths = [len(c[0]["content"]) for c in conversations]
    assert lengths[1] > 1000 > lengths[0] and lengths[3] > 1000 > lengths[2]
    assert len({c[1]["content"] for c in conversations}) == 4


def test_report_has_a_row_per_phase_and_p99_takes_the_tail() -> None:
    assert _p99([]) is None and _p99([1.0] * 98 + [5.0, 6.0]) == 5.0
    text = report([PhaseResult("peer", 0, sent=10, completed=8, failed=2),
                   PhaseResult("tandem", 3, sent=10, completed=10, migrated=2, p99_during_s=1.5)])
    rows = text.splitlines()
    assert rows[2].startswith("| peer | off | 10 | 8 | 2 | 0 |")
    assert rows[3].startswith("| tandem | limit 3 | 10 | 10 | 0 | 2 | 0 | 1.50 |")


def test_the_hostile_report_puts_the_phases_side_by_side() -> None:
    from tandem.bench.chaos import hostile_report

    calm = PhaseResult("calm", 3, sent=40, completed=40, p99_steady_s=2.0)
    hostile = PhaseResult("hostile", 3, sent=39, completed=39, p99_steady_s=2.1,
                          attacks={"nan_temperature": [3, 3], "forged_handle_via_router": [4, 3]},
                          attacks_through=["forged_handle_via_router: listener contacted"])
    text = hostile_report([calm, hostile])
    rows = text.splitlines()
    assert rows[2].startswith("| calm | 40 | 40 | 0 | 2.00 | 1.00x | 0 | 0 |")
    assert rows[3].startswith("| hostile | 39 | 39 | 0 | 2.10 | 1.05x | 7 | 6 |")
    assert "| forged_handle_via_router | 4 | 3 |" in text and "| nan_temperature | 3 | 3 |" in text
    assert report([calm, hostile]) == ""  # the fault table leaves them out


@pytest.mark.parametrize(("flags", "message"), [
    (["--phases", "peer,storm"], "--phases: unknown storm (peer, tandem, calm, hostile)"),
    (["--faults", "10:decode-0,soon"], "--faults: expected S:WORKER or S:cut:WORKER:D, got 'soon'"),
])
def test_bad_phases_and_faults_fail_at_parse_time(flags: list[str], message: str, tmp_path,
                                                  capsys) -> None:
    out = tmp_path / "chaos"
    with pytest.raises(SystemExit) as exited:
        main(["bench", "chaos", *flags, "--out", str(out)])
    assert exited.value.code == 2
    assert capsys.readouterr().err == f"tandem: error: {message}\n"
    assert not out.exists()  # the handler never ran
