"""`tandem bench overhead`: the split of a step into model time and engine overhead, beside a
baseline checkout measured by the same code in its own interpreter."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_overhead_bench_measures_us_and_a_baseline(tmp_path: Path) -> None:
    output = tmp_path / "overhead.json"
    done = subprocess.run([sys.executable, "-m", "tandem", "bench", "overhead", "--steps", "20", "--repeats", "1",
                           "--threads", "1", "--baseline", str(REPO), "--output", str(output)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {m.group(1): [float(x) for x in m.groups()[1:]]
            for m in re.finditer(r"^(tandem|baseline)\s+([\d.]+)\s+([\d.]+)\s+(\d+)\s+(\d+)\s+([\d.]+)%$",
                                 done.stdout, re.M)}
    assert set(rows) == {"tandem", "baseline"}, done.stdout
    for step_ms, model_ms, overhead_us, _p90, share in rows.values():
        assert 0 < model_ms < step_ms and 0 < overhead_us < step_ms * 1000 and 0 < share < 100
    assert "overhead: baseline / tandem = " in done.stdout
    results = json.loads(output.read_text())["results"]
    assert results["tandem"]["steps"] == 20
    # Greedy rows take the head's tokens without logits (greedy_tokens): model time, not overhead.
    assert 0 < results["tandem"]["head_s"] < results["tandem"]["model_s"]
    assert abs(results["tandem"]["overhead_s"] * 1e6 - rows["tandem"][2]) <= 1


def test_a_baseline_that_is_not_a_checkout_is_a_clear_error(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "tandem", "bench", "overhead", "--baseline", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and "not a tandem checkout" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_measuring_process_takes_the_commands_measure_flags() -> None:
    """The measuring process keeps a plain parser (it runs inside baseline checkouts); it must
    take the command's measure flags with the same defaults."""
    from tandem.bench.overhead import measure_parser
    from tandem.bench.overhead_cli import OVERHEAD_MEASURE_FLAGS

    parser = measure_parser()
    child = {a.option_strings[0]: a for a in parser._actions if a.option_strings[0] not in ("-h", "--measure")}
    assert set(child) == {flag.option for flag in OVERHEAD_MEASURE_FLAGS}
    for flag in OVERHEAD_MEASURE_FLAGS:
        assert (child[flag.option].default, child[flag.option].type) == (flag.default, flag.type)
    args = parser.parse_args(["--measure", *OVERHEAD_MEASURE_FLAGS.argv(
        parser.parse_args(["--measure", "--batch", "2", "--model", "m"]))])
    assert (args.batch, args.model, args.steps) == (2, "m", 200)


def test_counts_below_one_fail_at_parse_time() -> None:
    done = subprocess.run([sys.executable, "-m", "tandem", "bench", "overhead", "--steps", "0"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert done.stderr == "tandem: error: --repeats, --steps and --batch must be at least 1\n"
