"""The request bodies of `tandem bench tools`: validity cases per mode, the cost-of-constraining
workload and the jump-forward workload; and the server counters read around a run.

Cost of constraining: a constrained request cannot use `ignore_eos` (the grammar ends the
answer), so the workload asks for output that is long by its own shape: a catalogue of at
least 20 items of four fields each, which a 0.5B model keeps writing past any max_tokens of a
few hundred. The free requests send the same prompts without `response_format`, so both
decode about `max_tokens` tokens and the ratio of their output tok/s is the grammar's cost.

Jump-forward: records whose keys are long and fixed (`customer_preferred_communication_channel`)
and whose values are short, so most of an answer's tokens are forced by the schema and can be
appended without a model step. Tokens per model step over a run is generated / (generated -
forced), from the server's counters read before and after.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tandem.bench.tool_prompts import ToolCase

MODES = ("auto", "required", "strict")
MODE_TITLES = {
    "auto": 'tool_choice "auto"',
    "required": 'tool_choice "required"',
    "strict": 'tool_choice "auto", every function "strict": true',
}
GENERATION_COUNTER = "generation_tokens_total"
FORCED_COUNTER = "structured_forced_tokens_total"


def parse_modes(text: str) -> list[str]:
    """"auto,strict" -> ["auto", "strict"], in MODES order."""
    wanted = {x.strip() for x in text.split(",") if x.strip()}
    bad = sorted(wanted - set(MODES))
    if bad or not wanted:
        raise ValueError(f"--modes {text!r}: choose from {', '.join(MODES)} (comma-separated)")
    return [m for m in MODES if m in wanted]


def case_body(case: ToolCase, mode: str, model: str, max_tokens: int) -> dict[str, Any]:
    """One validity request: greedy, non-streamed, the case's tools under `mode`."""
    return {
        "model": model,
        "messages": [dict(m) for m in case.messages],
        "tools": case.openai_tools(strict=mode == "strict"),
        "tool_choice": "required" if mode == "required" else "auto",
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }


# --- cost of constraining --------------------------------------------------------------------

CATALOGUE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 20,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "category": {"type": "string"},
                    "description": {"type": "string"},
                    "rating": {"type": "integer", "minimum": 1, "maximum": 5},
                },
                "required": ["name", "category", "description", "rating"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["items"],
    "additionalProperties": False,
}
_TOPICS = ("novels for a long train ride", "board games for four players", "hiking trails in the Alps",
           "houseplants that tolerate shade", "weeknight vegetarian recipes", "science podcasts",
           "museums in Europe", "programming languages for beginners", "city bicycles",
           "single-origin coffees", "jazz albums from the 1960s", "stretching exercises",
           "open-source databases", "camping gear essentials", "tea varieties", "classic films")


def catalogue_prompts(count: int, tag: str = "") -> list[list[dict[str, str]]]:
    """`count` conversations asking for a 24-item JSON catalogue; `tag` sets the runs' prompts
    apart (a run must not find the other run's prompts in the prefix cache)."""
    system = f"You answer with JSON only.{f' Batch {tag}.' if tag else ''}"
    return [[{"role": "system", "content": system},
             {"role": "user", "content": (
                 f"Make a catalogue of 24 {_TOPICS[i % len(_TOPICS)]} (list {i + 1}). Answer with a JSON "
                 'object {"items": [...]}; each item has "name", "category", "description" (one '
                 'sentence) and "rating" (an integer from 1 to 5).')}]
            for i in range(count)]


def json_schema_format(name: str, schema: Mapping[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": dict(schema), "strict": True}}


def chat_body(model: str, messages: Sequence[Mapping[str, str]], max_tokens: int,
              response_format: Mapping[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": [dict(m) for m in messages],
                            "max_tokens": max_tokens, "temperature": 0.0}
    if response_format is not None:
        body["response_format"] = dict(response_format)
    return body


def cost_bodies(model: str, count: int, max_tokens: int, constrained: bool, tag: str) -> list[dict[str, Any]]:
    fmt = json_schema_format("catalogue", CATALOGUE_SCHEMA) if constrained else None
    return [chat_body(model, m, max_tokens, fmt) for m in catalogue_prompts(count, tag)]


# --- jump-forward ----------------------------------------------------------------------------


def _record(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


RECORD_SCHEMAS: dict[str, dict[str, Any]] = {
    "customer_record": _record({
        "customer_account_identifier_number": {"type": "integer", "minimum": 1, "maximum": 999999},
        "customer_primary_contact_full_name": {"type": "string", "maxLength": 40},
        "customer_preferred_communication_channel": {"enum": ["email_newsletter", "telephone_call",
                                                              "postal_mail_letter"]},
        "customer_marketing_consent_given": {"type": "boolean"},
        "customer_loyalty_program_membership_tier": {"enum": ["bronze_membership", "silver_membership",
                                                              "gold_membership", "platinum_membership"]},
        "customer_shipping_address_country_code": {"type": "string", "pattern": "^[A-Z]{2}$"},
        "customer_account_creation_calendar_year": {"type": "integer", "minimum": 1990, "maximum": 2025},
        "customer_has_open_support_tickets": {"type": "boolean"},
    }),
    "service_configuration": _record({
        "service_deployment_environment_name": {"enum": ["development_environment", "staging_environment",
                                                         "production_environment"]},
        "service_maximum_concurrent_connections": {"type": "integer", "minimum": 1, "maximum": 10000},
        "service_request_timeout_in_milliseconds": {"type": "integer", "minimum": 10, "maximum": 60000},
        "service_enable_structured_request_logging": {"type": "boolean"},
        "service_health_check_endpoint_path": {"type": "string", "maxLength": 30},
        "service_automatic_horizontal_scaling_enabled": {"type": "boolean"},
        "service_persistent_storage_backend_kind": {"enum": ["postgresql_database", "object_storage_bucket",
                                                             "local_disk_volume"]},
        "service_minimum_healthy_replica_count": {"type": "integer", "minimum": 0, "maximum": 100},
    }),
    "sensor_reading": _record({
        "environmental_sensor_device_serial_number": {"type": "string", "pattern": "^SN-[0-9]{4}$"},
        "measured_ambient_temperature_in_celsius": {"type": "number"},
        "measured_relative_humidity_in_percent": {"type": "integer", "minimum": 0, "maximum": 100},
        "measured_barometric_pressure_in_hectopascal": {"type": "integer", "minimum": 800, "maximum": 1100},
        "sensor_battery_charge_state_category": {"enum": ["battery_fully_charged", "battery_half_charged",
                                                          "battery_nearly_empty"]},
        "sensor_firmware_update_currently_pending": {"type": "boolean"},
        "sensor_installation_location_description": {"type": "string", "maxLength": 30},
    }),
}
_RECORD_PROMPTS = {
    "customer_record": "Fill in the customer record for {who} as JSON.",
    "service_configuration": "Write the configuration of the {who} service as JSON.",
    "sensor_reading": "Report the latest reading of the sensor in {who} as JSON.",
}
_RECORD_SUBJECTS = {
    "customer_record": ("Maria Lopez of Madrid, a gold member since 2014", "Tom Chen, who joined in 2021",
                        "Anil Kumar from India, no marketing emails", "Nina Rossi, platinum, prefers phone"),
    "service_configuration": ("checkout API in production", "search indexer on staging",
                              "billing worker in development", "auth gateway in production"),
    "sensor_reading": ("the greenhouse", "the server room", "the north attic", "the cold store"),
}


def record_bodies(model: str, count: int, max_tokens: int, tag: str = "") -> list[dict[str, Any]]:
    """`count` schema-heavy requests cycling over the record schemas and their subjects."""
    bodies = []
    names = list(RECORD_SCHEMAS)
    for i in range(count):
        name = names[i % len(names)]
        subjects = _RECORD_SUBJECTS[name]
        who = subjects[i // len(names) % len(subjects)]
        system = f"You answer with JSON only.{f' Batch {tag}.' if tag else ''}"
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": _RECORD_PROMPTS[name].format(who=who)}]
        bodies.append(chat_body(model, messages, max_tokens, json_schema_format(name, RECORD_SCHEMAS[name])))
    return bodies


# --- server counters -------------------------------------------------------------------------


def parse_counters(text: str) -> dict[str, float]:
    """Prometheus exposition text -> sample name -> value summed over its label sets."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + float(sample.value)
    return totals


def counter(counters: Mapping[str, float], suffix: str) -> float | None:
    """A counter by its name after the server's prefix (`tandem:`, `vllm:`); None: absent."""
    found = [v for name, v in counters.items() if name == suffix or name.endswith(":" + suffix)]
    return sum(found) if found else None


def tokens_per_step(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float | None]:
    """Generated and forced tokens over a run and generated / (generated - forced); the forced
    figures are None when the server has no forced-token counter."""
    gen0, gen1 = counter(before, GENERATION_COUNTER), counter(after, GENERATION_COUNTER)
    generated = None if gen0 is None or gen1 is None else gen1 - gen0
    f0, f1 = counter(before, FORCED_COUNTER), counter(after, FORCED_COUNTER)
    forced = None if f1 is None else f1 - (f0 or 0.0)
    ratio = None
    if generated is not None and forced is not None and generated - forced > 0:
        ratio = generated / (generated - forced)
    return {"generated_tokens": generated, "forced_tokens": forced, "tokens_per_step": ratio}
