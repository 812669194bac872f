"""`tandem bench tools`: its cases, its scoring, its counters, its flags, and the command run
against a real `tandem serve` on the default model."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from jsonschema import Draft202012Validator

from tandem.bench import tool_scoring
from tandem.bench.serve import tandem_command
from tandem.bench.tool_prompts import (
    KINDS,
    MAX_TOOLS,
    MIN_TOOLS,
    TOOLS,
    build_cases,
    unused_placeholders,
)
from tandem.bench.tool_scoring import check_call, failure_examples, score_response, summarize
from tandem.bench.tools import (
    NO_JUMP_FORWARD,
    VLLM_TOOL_ARGS,
    _launch_args,
    check_tools_args,
    parse_levels,
    plan_targets,
)
from tandem.bench.tools_client import post_all_async
from tandem.bench.tools_report import TargetRun, format_report, goal_lines
from tandem.bench.tools_workloads import (
    CATALOGUE_SCHEMA,
    RECORD_SCHEMAS,
    case_body,
    cost_bodies,
    parse_counters,
    parse_modes,
    record_bodies,
    tokens_per_step,
)
from tandem.cli.main import build_parser, main

# --- the cases -------------------------------------------------------------------------------


def test_at_least_200_cases_of_every_kind_with_2_to_6_tools() -> None:
    cases = build_cases()
    assert len(cases) >= 200
    assert len({c.case_id for c in cases}) == len(cases)
    kinds = Counter(c.kind for c in cases)
    assert set(kinds) == set(KINDS) and min(kinds.values()) >= 40
    assert len(TOOLS) >= 30 and len({t.name for t in TOOLS}) == len(TOOLS)
    for case in cases:
        names = [t.name for t in case.tools]
        assert MIN_TOOLS <= len(names) <= MAX_TOOLS and len(set(names)) == len(names), case.case_id
        assert set(case.expected) <= set(names), case.case_id
        assert len(case.expected) == (2 if case.kind == "parallel" else 1), case.case_id
        assert case.messages[-1]["role"] == "user"
        assert "{" not in case.messages[-1]["content"], case.messages[-1]["content"]  # every slot filled
    assert unused_placeholders() == []
    # the expected tools do not always come first: the lists are shuffled
    assert Counter(c.tools[0].name == c.expected[0] for c in cases)[False] > len(cases) // 2


def test_every_tool_schema_is_a_valid_draft_2020_12_schema() -> None:
    for tool in TOOLS:
        Draft202012Validator.check_schema(tool.parameters)
        assert tool.parameters["type"] == "object" and tool.parameters["additionalProperties"] is False
    for schema in (CATALOGUE_SCHEMA, *RECORD_SCHEMAS.values()):
        Draft202012Validator.check_schema(schema)


def test_the_schemas_use_nesting_arrays_enums_and_ranges() -> None:
    text = json.dumps([t.parameters for t in TOOLS])
    for keyword in ('"enum"', '"items"', '"minimum"', '"maximum"', '"required"', '"pattern"'):
        assert keyword in text
    nested = [t.name for t in TOOLS if any(p.get("type") == "object" for p in t.parameters["properties"].values())]
    assert len(nested) >= 5


def test_the_cases_are_deterministic_and_the_seed_changes_them() -> None:
    first, again = build_cases(), build_cases()
    assert [c.summary() for c in first] == [c.summary() for c in again]
    assert [c.summary() for c in build_cases(seed=1)] != [c.summary() for c in first]
    # a prefix of the set is the same prefix, and holds every kind
    head = build_cases(8)
    assert [c.case_id for c in head] == [c.case_id for c in first[:8]]
    assert {c.kind for c in head} == set(KINDS)
    with pytest.raises(ValueError, match="num-cases"):
        build_cases(0)


def test_request_bodies_per_mode() -> None:
    case = build_cases(1)[0]
    auto = case_body(case, "auto", "m", 256)
    assert auto["tool_choice"] == "auto" and auto["temperature"] == 0.0 and auto["max_tokens"] == 256
    assert all("strict" not in t["function"] for t in auto["tools"])
    assert case_body(case, "required", "m", 256)["tool_choice"] == "required"
    strict = case_body(case, "strict", "m", 256)
    assert strict["tool_choice"] == "auto" and all(t["function"]["strict"] is True for t in strict["tools"])
    constrained = cost_bodies("m", 3, 128, True, "x")
    assert len(constrained) == 3 and constrained[0]["response_format"]["json_schema"]["strict"] is True
    free = cost_bodies("m", 3, 128, False, "x")
    assert "response_format" not in free[0] and free[0]["messages"] == constrained[0]["messages"]
    assert {b["response_format"]["json_schema"]["name"] for b in record_bodies("m", 6, 64)} == set(RECORD_SCHEMAS)


# --- scoring ---------------------------------------------------------------------------------


def _case(kind: str = "single"):
    return next(c for c in build_cases() if c.kind == kind and c.expected[0] == "get_current_weather")


def _response(*calls: tuple[str, Any], content: str | None = None) -> dict[str, Any]:
    tool_calls = [{"id": f"call_{i}", "type": "function",
                   "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}}
                  for i, (name, args) in enumerate(calls)]
    message = {"role": "assistant", "content": content, "tool_calls": tool_calls or None}
    return {"choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if calls else "stop"}],
            "usage": {"prompt_tokens": 300, "completion_tokens": 20}}


WEATHER = {"location": "Lisbon", "unit": "celsius"}
SCHEMAS = {t.name: t.parameters for t in TOOLS}


def test_a_valid_call_scores_valid_with_exact_names() -> None:
    score = score_response(_case(), _response(("get_current_weather", WEATHER)))
    assert score.valid and score.exact_names and not score.no_call
    assert [c.verdict for c in score.calls] == ["valid"] and score.completion_tokens == 20


@pytest.mark.parametrize("arguments, fragment", [
    ({"location": "Lisbon", "unit": "kelvin"}, "unit"),  # not in the enum
    ({"unit": "celsius"}, "location"),  # a required field missing
    ({"location": "Lisbon", "country": "PT"}, "country"),  # an argument the tool does not take
    ({"location": 42}, "location"),  # the wrong type
])
def test_arguments_that_break_the_schema(arguments: dict[str, Any], fragment: str) -> None:
    check = check_call({"function": {"name": "get_current_weather", "arguments": json.dumps(arguments)}}, SCHEMAS)
    assert check.verdict == "schema_invalid" and fragment in check.detail


def test_integer_ranges_and_nested_objects_are_validated() -> None:
    good = {"room": "kitchen", "power": "on", "color": {"r": 1, "g": 2, "b": 3}}
    assert check_call({"function": {"name": "set_light", "arguments": json.dumps(good)}}, SCHEMAS).verdict == "valid"
    for bad in ({**good, "brightness": 101}, {**good, "color": {"r": 1, "g": 2}}, {**good, "color": {"r": 1, "g": 2, "b": 300}}):
        check = check_call({"function": {"name": "set_light", "arguments": json.dumps(bad)}}, SCHEMAS)
        assert check.verdict == "schema_invalid", bad


def test_the_scoring_depends_on_the_validator(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation check: with a validator that accepts anything, the schema tests above would fail."""
    bad = {"function": {"name": "get_current_weather", "arguments": json.dumps({"unit": "kelvin"})}}
    assert check_call(bad, SCHEMAS).verdict == "schema_invalid"
    monkeypatch.setattr(tool_scoring, "validation_error", lambda schema, instance: None)
    assert check_call(bad, SCHEMAS).verdict == "valid"


def test_unknown_names_malformed_json_and_non_string_arguments() -> None:
    unknown = score_response(_case(), _response(("get_weather", WEATHER)))
    assert [c.verdict for c in unknown.calls] == ["unknown_tool"] and not unknown.valid and not unknown.exact_names
    broken = score_response(_case(), _response(("get_current_weather", '{"location": "Lisbon"')))
    assert [c.verdict for c in broken.calls] == ["malformed_json"] and not broken.valid
    assert broken.exact_names  # the right tool, badly written: names and validity are apart
    as_object = {"choices": [{"message": {"tool_calls": [{"function": {"name": "get_current_weather",
                                                                       "arguments": WEATHER}}]}}]}
    assert [c.verdict for c in score_response(_case(), as_object).calls] == ["malformed_json"]
    no_function = {"choices": [{"message": {"tool_calls": [{"id": "x"}]}}]}
    assert [c.verdict for c in score_response(_case(), no_function).calls] == ["malformed_json"]


def test_no_call_call_like_text_and_errors() -> None:
    prose = score_response(_case(), _response(content="It is sunny in Lisbon."))
    assert prose.no_call and not prose.call_like_text and not prose.valid and not prose.exact_names
    leaked = score_response(_case(), _response(content='<tool_call>\n{"name": "get_current_weather", "arg'))
    assert leaked.no_call and leaked.call_like_text
    failed = score_response(_case(), None, error="HTTP 400: strict is not supported")
    assert failed.error and not failed.no_call and not failed.valid
    empty = score_response(_case(), {"choices": []})
    assert empty.error is not None


def test_parallel_names_are_a_multiset() -> None:
    case = next(c for c in build_cases() if c.kind == "parallel" and c.expected[0] == c.expected[1])
    name = case.expected[0]
    args = {"get_current_weather": WEATHER, "get_stock_quote": {"symbol": "IBM"},
            "lookup_order": {"order_id": "ORD-123456"}}[name]
    assert score_response(case, _response((name, args), (name, args))).exact_names
    assert not score_response(case, _response((name, args))).exact_names  # one call of two
    assert not score_response(case, _response((name, args), (name, args), (name, args))).exact_names
    mixed = next(c for c in build_cases() if c.kind == "parallel" and c.expected[0] != c.expected[1])
    a, b = mixed.expected
    assert score_response(mixed, _response((b, "{}"), (a, "{}"))).exact_names  # order does not matter


def test_summary_rates() -> None:
    case = _case()
    scores = [
        score_response(case, _response(("get_current_weather", WEATHER))),
        score_response(case, _response(("get_current_weather", {"unit": "celsius"}))),
        score_response(case, _response(content="<tool_call>")),
        score_response(case, None, error="HTTP 400: no"),
    ]
    summary = summarize(scores)
    assert summary["cases"] == 4 and summary["valid_pct"] == 25.0 and summary["exact_names_pct"] == 50.0
    assert summary["no_call_pct"] == 25.0 and summary["call_like_text_pct"] == 25.0
    assert summary["errors"] == 1 and summary["first_error"] == "HTTP 400: no"
    assert summary["calls"] == 2 and summary["calls_valid_pct"] == 50.0 and summary["schema_invalid"] == 1
    assert summary["exact_names_single_pct"] == 50.0 and summary["exact_names_parallel_pct"] is None
    assert len(failure_examples(scores)) == 3


# --- counters, reports -----------------------------------------------------------------------

METRICS = """\
# HELP tandem:generation_tokens_total Generated tokens.
# TYPE tandem:generation_tokens_total counter
tandem:generation_tokens_total{model_name="m"} %s
# TYPE tandem:structured_forced_tokens_total counter
tandem:structured_forced_tokens_total{model_name="m"} %s
"""


def test_tokens_per_step_from_the_counters() -> None:
    before, after = parse_counters(METRICS % (100, 10)), parse_counters(METRICS % (400, 160))
    figures = tokens_per_step(before, after)
    assert figures == {"generated_tokens": 300.0, "forced_tokens": 150.0, "tokens_per_step": 2.0}
    # a server without the forced-token counter: n/a, not 1.0
    plain = "tandem:generation_tokens_total{model_name=\"m\"} %s\n"
    missing = tokens_per_step(parse_counters(plain % 5), parse_counters(plain % 50))
    assert missing == {"generated_tokens": 45.0, "forced_tokens": None, "tokens_per_step": None}
    # a peer's prefix
    peer = tokens_per_step(parse_counters("vllm:generation_tokens_total 1\n"),
                           parse_counters("vllm:generation_tokens_total 9\n"))
    assert peer["generated_tokens"] == 8.0


def test_the_report_prints_n_a_and_judges_the_goals() -> None:
    case = _case()
    run = TargetRun("tandem", validity={"strict": [score_response(case, _response(("get_current_weather", WEATHER)))],
                                        "required": [score_response(case, _response(content="hi"))]})
    entry = {"requests": 4, "errors": 0, "first_error": None, "mean_output_tokens": 128.0,
             "finish_reasons": {"length": 4}}
    run.cost = [{"concurrency": 1, "free": {**entry, "output_tok_s": 20.0},
                 "constrained": {**entry, "output_tok_s": 19.5}, "ratio": 0.975},
                {"concurrency": 32, "free": {**entry, "output_tok_s": 100.0},
                 "constrained": {**entry, "errors": 4, "output_tok_s": None, "first_error": "HTTP 400"},
                 "ratio": None}]
    run.jump = {"on": {"requests": 4, "errors": 0, "generated_tokens": 100.0, "forced_tokens": None,
                       "tokens_per_step": None, "output_tok_s": 12.0}}
    goals = goal_lines(run)
    assert any("strict" in g and g.endswith(": met") for g in goals)
    assert any("required" in g and "NOT met" in g for g in goals)
    assert any("concurrency 1" in g and g.endswith(": met") for g in goals)
    assert any("concurrency 32" in g and "not measured" in g for g in goals)
    assert any("jump-forward" in g and "not measured" in g for g in goals)
    text = format_report([run], ["auto", "required", "strict"], "title")
    assert "n/a" in text and "HTTP 400" in text and 'tool_choice "required"' in text


def test_the_client_keeps_order_and_records_errors() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body["max_tokens"] == 2:
            return httpx.Response(400, json={"error": {"message": "response_format is not supported"}})
        return httpx.Response(200, json={"choices": [{"message": {"content": "x"}, "finish_reason": "length"}],
                                         "usage": {"completion_tokens": body["max_tokens"]}})

    bodies = [{"max_tokens": n} for n in (5, 2, 7, 3)]
    batch = asyncio.run(post_all_async("http://test", bodies, 2, transport=httpx.MockTransport(handler)))
    assert [r.index for r in batch.replies] == [0, 1, 2, 3]
    assert batch.errors == ["HTTP 400: response_format is not supported"]
    assert batch.output_tokens == 15 and batch.replies[0].finish_reason == "length"


# --- flags -----------------------------------------------------------------------------------


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "tools", *argv])


def test_flags_and_their_defaults() -> None:
    args = _parse()
    assert (args.model, args.modes, args.concurrency, args.max_tokens) == ("qwen2.5-coder-0.5b", "auto,required,strict", 4, 256)
    assert args.num_cases is None and not args.skip_cost and not args.skip_jump_forward
    check_tools_args(args)
    args = _parse("--num-cases", "4", "--modes", "strict,auto", "--skip-cost", "--skip-jump-forward",
                  "--model", "smollm2-135m", "--url", "peer=http://127.0.0.1:9", "--launch", "tandem")
    check_tools_args(args)
    assert parse_modes(args.modes) == ["auto", "strict"] and args.skip_cost and args.skip_jump_forward
    assert [t.name for t in plan_targets(args.url, args.launch)] == ["tandem", "peer"]
    assert [t.launch for t in plan_targets([], [])] == ["tandem"]  # nothing given: launch tandem
    assert [t.url for t in plan_targets(["http://127.0.0.1:8000"], [])] == ["http://127.0.0.1:8000"]
    assert parse_levels("32,1,1") == [1, 32]


def test_launched_servers_get_the_flags_this_bench_needs() -> None:
    args = _parse("--tandem-args", "--threads 2", "--vllm-args", "--seed 1")
    assert _launch_args(args, "vllm").vllm_args == f"{VLLM_TOOL_ARGS} --seed 1"  # vLLM parses calls only when told
    off = _launch_args(args, "tandem", no_jump_forward=True)
    assert tandem_command(off, 8000)[-3:] == ["--threads", "2", NO_JUMP_FORWARD]
    assert NO_JUMP_FORWARD not in tandem_command(_launch_args(args, "tandem"), 8000)
    assert args.tandem_args == "--threads 2"  # the caller's namespace is left as it was


@pytest.mark.parametrize("argv, message", [
    (["--modes", "auto,fast"], "--modes"),
    (["--modes", ""], "--modes"),
    (["--cost-concurrency", "0"], "--cost-concurrency"),
    (["--cost-concurrency", "a"], "--cost-concurrency"),
    (["--num-cases", "0"], "--num-cases"),
    (["--launch", "sglang"], "--launch"),
    (["--url", "localhost:8000"], "--url"),
    (["--url", "a=http://h:1", "--url", "a=http://h:2"], "differ"),
])
def test_bad_flags_are_refused_before_anything_starts(argv: list[str], message: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match=message):
        check_tools_args(_parse(*argv))
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "tools", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


# --- against a real server -------------------------------------------------------------------


def _report(path: Path) -> dict[str, Any]:
    report = json.loads(path.read_text())
    assert report["schema"] == "tandem.bench.tools/1"
    return report


@pytest.mark.slow
def test_the_command_against_a_launched_tandem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report_path = tmp_path / "tools.json"
    # auto and required share each prompt (required adds the call's opening), so the second mode
    # is served from the prefix cache; strict's prompts differ, and its body has a test above
    code = main(["bench", "tools", "--model", "smollm2-135m", "--num-cases", "4", "--modes", "auto,required",
                 "--max-tokens", "32", "--skip-cost", "--skip-jump-forward", "--kv-cache-memory", "256MiB",
                 "--report", str(report_path), "--output-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    report = _report(report_path)
    (target,) = report["targets"]
    assert target["name"] == "tandem" and target["error"] is None and target["launch"]["returncode"] == 0
    assert set(target["validity"]) == {"auto", "required"}
    for mode, part in target["validity"].items():
        assert part["summary"]["cases"] == 4 and len(part["scores"]) == 4, mode
        for score in part["scores"]:  # a response or a counted error, every one scored
            assert score["error"] is not None or score["completion_tokens"] is not None
    assert target["cost"] == [] and target["jump_forward"] == {}
    assert len(report["cases"]) == 4 and report_path.with_suffix(".png").stat().st_size > 0
    for mode_title in ('tool_choice "auto"', 'tool_choice "required"'):
        assert mode_title in out
    assert "no peer in this run" in out


def test_cost_and_jump_forward_parts_against_a_running_server(tandem_server: str, tmp_path: Path) -> None:
    """Tiny sizes: the parts run end to end and read /metrics; a server that refuses
    response_format is counted, not fatal."""
    report_path = tmp_path / "tools.json"
    code = main(["bench", "tools", "--url", f"tandem={tandem_server}", "--num-cases", "1", "--modes", "auto",
                 "--max-tokens", "8", "--cost-concurrency", "1", "--cost-requests", "1", "--cost-max-tokens", "8",
                 "--jump-requests", "1", "--jump-max-tokens", "8", "--report", str(report_path)])
    assert code == 0
    (target,) = _report(report_path)["targets"]
    (cost,) = target["cost"]
    for kind in ("free", "constrained"):
        part = cost[kind]
        assert part["requests"] == 1
        assert part["errors"] == 1 or part["output_tokens"] > 0
    assert cost["free"]["errors"] == 0 and cost["free"]["output_tok_s"] > 0
    jump = target["jump_forward"]["as running"]
    if jump["errors"] == 0:
        assert jump["generated_tokens"] >= jump["output_tokens"] > 0  # the counter moved with the run
    else:
        assert jump["first_error"]
