"""Integer weight quantization in `compressed-tensors`' pack-quantized format, as the plan sizes it.

Kimi K2.5 ships its routed experts this way (`quant_method: compressed-tensors`,
`format: pack-quantized`, 4-bit symmetric integers in groups of 32). A `config_groups` entry
says which modules it quantizes (`targets`: the class name `Linear`, a module name, or
`re:<regex>`), `ignore` which of those stay unquantized (the same forms); everything else,
and every module that is not a matmul (embeddings, norms, DeepSeek's router, which is not an
nn.Linear), stays in the model dtype. Names are matched as compressed-tensors matches them,
`re.match` against the module's name in the text model (`model.layers.3.mlp.experts.7.up_proj`,
`lm_head`).

A quantized matrix W [out, in] is stored as (b bits, p = 32 / b values per int32 word,
g groups per row: in / group_size for the `group` strategy, 1 for `channel`):

    weight_packed       int32 [out, ceil(in / p)]       b bits per weight
    weight_scale        [out, g] in the scale dtype (the model dtype unless the scheme says)
    weight_zero_point   int32 [ceil(out / p), g]        asymmetric schemes only, packed like the weights
    weight_g_idx        int32 [in]                      activation ordering `group` only
    weight_shape        int32 [2]                       the unpacked [out, in]

so Kimi K2.5's 2048 x 7168 expert projection is 2048 x 896 x 4 + 2048 x 224 x 2 + 8 bytes,
4.5 bits a weight. Schemes the plan cannot size this way (other formats, float or
activation-quantized types, other strategies, a quantized KV cache, sparsity or transforms)
are refused with a `PlanError` naming what, rather than planned wrong.

Imports nothing from tandem but the error, so `shape` can parse a config with it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from tandem.sizing.errors import PlanError

FORMAT = "pack-quantized"
BITS = (4, 8)  # vLLM's WNA16 kernels: 4- and 8-bit integer weights
STRATEGIES = ("group", "channel")
SCALE_DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}
EXPERT = "{expert}"  # stands for the expert index in a routed expert's module name


@dataclass(frozen=True)
class IntScheme:
    """One config group's weights: b-bit integers with a scale per group (or per row)."""

    num_bits: int
    strategy: str  # group | channel
    group_size: int  # 0 for channel
    symmetric: bool  # False: a packed int32 zero point per group as well
    g_idx: bool  # activation ordering `group`: an int32 group index per input column
    scale_dtype: str | None  # None: the model dtype
    targets: tuple[str, ...]

    @property
    def per_word(self) -> int:
        return 32 // self.num_bits

    def groups(self, cols: int) -> int:
        return -(-cols // self.group_size) if self.strategy == "group" else 1

    def matrix_bytes(self, rows: int, cols: int, dtype_bytes: int) -> int:
        """Stored bytes of one [rows, cols] matrix (one rank's slice of it), every tensor above."""
        groups = self.groups(cols)
        scale = SCALE_DTYPES[self.scale_dtype] if self.scale_dtype else dtype_bytes
        packed = rows * -(-cols // self.per_word) * 4
        zero = 0 if self.symmetric else -(-rows // self.per_word) * groups * 4
        return packed + rows * groups * scale + zero + (cols * 4 if self.g_idx else 0) + 2 * 4

    def __str__(self) -> str:
        how = f"groups of {self.group_size}" if self.strategy == "group" else "one scale per row"
        kind = "symmetric" if self.symmetric else "asymmetric, packed zero points"
        scale = f", {self.scale_dtype} scales" if self.scale_dtype else ""
        return f"int{self.num_bits} ({kind}, {how}{scale})"


@dataclass(frozen=True)
class CompressedTensors:
    """A compressed-tensors `quantization_config` the plan can size."""

    schemes: tuple[IntScheme, ...]
    ignore: tuple[str, ...]

    def scheme_for(self, module: str, experts: int = 0) -> IntScheme | None:
        """The scheme that quantizes the nn.Linear `module`, or None if it stays unquantized.
        A routed expert's name holds `{expert}`: every expert must get the same answer."""
        if EXPERT not in module:
            return _scheme_for(self, module)
        first = _scheme_for(self, module.replace(EXPERT, "0"))
        last = _scheme_for(self, module.replace(EXPERT, str(max(experts - 1, 0))))
        if first != last:
            raise PlanError(f"compressed-tensors rules that quantize some routed experts of "
                            f"{module.replace(EXPERT, '*')} and not others are not supported by the memory plan")
        return first

    def __str__(self) -> str:
        return " / ".join(dict.fromkeys(str(s) for s in self.schemes))


@lru_cache(maxsize=4096)
def _scheme_for(quant: CompressedTensors, module: str) -> IntScheme | None:
    if any(_matches(rule, module) for rule in quant.ignore):
        return None
    for scheme in quant.schemes:
        if any(_matches(target, module) for target in scheme.targets):
            return scheme
    return None


def _matches(rule: str, module: str) -> bool:
    """compressed-tensors' rule forms: `re:<regex>` (re.match on the name), the class name
    `Linear` (every matmul the plan asks about is one), or a module's exact name."""
    if rule.startswith("re:"):
        return re.match(rule[3:], module) is not None
    return rule == "Linear" or rule == module


def read_compressed_tensors(quant: dict[str, Any]) -> CompressedTensors:
    """The sizable parts of a compressed-tensors `quantization_config`; `PlanError` naming the
    first thing the plan cannot size."""
    def refuse(what: str) -> PlanError:
        return PlanError(f"compressed-tensors {what} is not supported by the memory plan (it sizes "
                         f"{FORMAT} integer weights of {' or '.join(map(str, BITS))} bits, "
                         f"strategy {' or '.join(STRATEGIES)}); pass --dtype to plan the model unquantised")

    fmt = quant.get("format") or FORMAT
    if fmt != FORMAT:
        raise refuse(f"format {fmt!r}")
    status = quant.get("quantization_status") or "compressed"
    if status != "compressed":
        raise refuse(f"quantization_status {status!r} (the checkpoint is not stored compressed)")
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if quant.get(key):
            raise refuse(f"{key} {quant[key]!r}")
    groups = quant.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise refuse("quantization_config without config_groups")
    ignore = quant.get("ignore") or []
    _check_rules("ignore", ignore, refuse)
    schemes = tuple(_scheme(name, group, fmt, refuse) for name, group in groups.items())
    return CompressedTensors(schemes, tuple(ignore))


def _scheme(name: str, group: Any, fmt: str, refuse) -> IntScheme:  # noqa: ANN001 - refuse: str -> PlanError
    if not isinstance(group, dict):
        raise refuse(f"config group {name!r} that is not an object")
    targets = group.get("targets") or []
    _check_rules(f"{name} targets", targets, refuse)
    if not targets:
        raise refuse(f"config group {name!r} without targets")
    if (group.get("format") or fmt) != FORMAT:
        raise refuse(f"{name} format {group.get('format')!r}")
    inputs = group.get("input_activations")
    if inputs and not inputs.get("dynamic"):
        raise refuse(f"{name} static input_activations (stored input scales)")
    if group.get("output_activations"):
        raise refuse(f"{name} output_activations")
    w = group.get("weights")
    if not isinstance(w, dict):
        raise refuse(f"{name} without weights")
    if w.get("type", "int") != "int":
        raise refuse(f"{name} weights of type {w.get('type')!r}")
    bits = w.get("num_bits")
    if bits not in BITS:
        raise refuse(f"{name} num_bits {bits!r}")
    strategy = w.get("strategy")
    if strategy not in STRATEGIES:
        raise refuse(f"{name} strategy {strategy!r}")
    group_size = w.get("group_size") if strategy == "group" else 0
    if strategy == "group" and (not isinstance(group_size, int) or group_size < 1):
        raise refuse(f"{name} group strategy with group_size {group_size!r}")
    if w.get("dynamic"):
        raise refuse(f"{name} dynamic weights")
    if w.get("block_structure"):
        raise refuse(f"{name} block_structure {w['block_structure']!r}")
    actorder = w.get("actorder")
    if actorder not in (None, "group", "weight"):
        raise refuse(f"{name} actorder {actorder!r}")
    scale_dtype = w.get("scale_dtype")
    if scale_dtype is not None:
        scale_dtype = str(scale_dtype).removeprefix("torch.")
        if scale_dtype not in SCALE_DTYPES:
            raise refuse(f"{name} scale_dtype {scale_dtype!r}")
    return IntScheme(num_bits=bits, strategy=strategy, group_size=group_size,
                     symmetric=w.get("symmetric", True) is not False,
                     g_idx=actorder == "group" and strategy == "group", scale_dtype=scale_dtype,
                     targets=tuple(targets))


def _check_rules(what: str, rules: Any, refuse) -> None:  # noqa: ANN001
    """Rules are names or regexes; a class name other than Linear (an Embedding, a decoder
    layer) would quantize tensors the plan keeps unquantized, so it is refused."""
    if not isinstance(rules, list) or not all(isinstance(r, str) for r in rules):
        raise refuse(f"{what} {rules!r} (not a list of names)")
    for rule in rules:
        if rule.startswith("re:"):
            try:
                re.compile(rule[3:])
            except re.error as exc:
                raise refuse(f"{what} rule {rule!r} ({exc})") from None
        elif rule != "Linear" and rule[:1].isupper():
            raise refuse(f"{what} rule {rule!r} (a module class other than Linear)")
