"""Expert parallelism on gloo: two ranks, each holding half of the experts whole (the router
and shared experts whole on both), dispatching token rows to the experts' ranks and
combining them back with all-to-alls, give the unsplit FusedMoE's output on every rank."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tandem
from tandem.config import MoeConfig
from tandem.distributed.expert_parallel import ExpertParallel
from tandem.layers.moe import FusedMoE, route
from tandem.platform.ports import free_port

HIDDEN = 24
TOKENS = (0, 1, 5, 64)  # an empty step, fewer tokens than ranks, an uneven split, a prefill
CONFIGS = {
    "mixtral-softmax": MoeConfig(num_experts=8, top_k=2, intermediate_size=16),
    # 4 groups of 2, the best 2 groups eligible: the bias and the group limit change choices
    "deepseek-v3-grouped-shared": MoeConfig(
        num_experts=8, top_k=2, intermediate_size=16, scoring="sigmoid", n_group=4, topk_group=2,
        routed_scaling_factor=2.5, correction_bias=True, num_shared_experts=1),
}



def _rank_env() -> dict[str, str]:
    """The rank scripts import the tandem this test imported (a script's sys.path starts at
    its own folder, so an editable install elsewhere, a git worktree's main checkout, would
    otherwise win)."""
    source = str(Path(tandem.__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [source, os.environ.get("PYTHONPATH")]))}


def _whole_layer(config: MoeConfig) -> tuple[FusedMoE, dict]:
    """An unsplit layer with random weights, and those weights as a checkpoint would hold them."""
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int, scale: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

    inter = config.intermediate_size
    data = {
        "config": dict(config.__dict__), "hidden": HIDDEN, "gate": randn(config.num_experts, HIDDEN),
        "correction_bias": randn(config.num_experts, scale=0.5),
        "experts": [{"gate": randn(inter, HIDDEN), "up": randn(inter, HIDDEN), "down": randn(HIDDEN, inter)}
                    for _ in range(config.num_experts)],
        "shared": {"gate": randn(inter, HIDDEN), "up": randn(inter, HIDDEN), "down": randn(HIDDEN, inter)},
        "inputs": [randn(tokens, HIDDEN, scale=1.0) for tokens in TOKENS],
        "residual": randn(TOKENS[-1], HIDDEN, scale=1.0),
    }
    moe = FusedMoE(config, HIDDEN)
    moe.gate.data.copy_(data["gate"])
    if moe.correction_bias is not None:
        moe.correction_bias.data.copy_(data["correction_bias"])
    for expert, projections in enumerate(data["experts"]):
        for projection, tensor in projections.items():
            moe.load_expert(expert, projection, tensor)
    if moe.shared_experts is not None:
        moe.shared_experts.gate_up_proj.load("weight", data["shared"]["gate"], 0)
        moe.shared_experts.gate_up_proj.load("weight", data["shared"]["up"], 1)
        moe.shared_experts.down_proj.load("weight", data["shared"]["down"])
    return moe, data


@pytest.mark.parametrize("name", list(CONFIGS))
def test_two_expert_parallel_ranks_give_the_unsplit_layer_s_output(name: str, tmp_path: Path) -> None:
    config = CONFIGS[name]
    reference, data = _whole_layer(config)
    torch.save(data, tmp_path / "case.pt")
    port = free_port()
    script = Path(__file__).with_name("ep_rank.py")
    ranks = [
        subprocess.Popen([sys.executable, str(script), str(rank), "2", str(port), str(tmp_path / "case.pt"),
                          str(tmp_path / f"rank{rank}.pt")],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_rank_env())
        for rank in range(2)
    ]
    try:
        for process in ranks:
            output, _ = process.communicate(timeout=60)
            saved = [(tmp_path / f"rank{rank}.pt").exists() for rank in range(2)]
            assert process.returncode == 0, f"results saved by rank 0, 1: {saved}\n{output}"
    finally:
        for process in ranks:
            process.kill()

    with torch.inference_mode():
        expected = [reference(x) for x in data["inputs"]]
        # the test means something: both ranks' token slices send rows to both ranks' experts
        x = data["inputs"][-1]
        _, chosen = route(F.linear(x, reference.gate), config, reference.correction_bias)
        for half in (chosen[:32], chosen[32:]):
            assert (half < 4).any() and (half >= 4).any()
    whole_experts = reference.w13.numel() + reference.w2.numel()
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for tokens, out, want in zip(TOKENS, got["outputs"], expected, strict=True):
            assert out.shape == (tokens, HIDDEN)
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["with_residual"], data["residual"] + expected[-1],
                                   rtol=1e-5, atol=1e-5)
        # half of the experts each, whole (not split by intermediate size); the router and
        # the shared expert whole on both ranks
        assert got["local"] == (4 * rank, 4)
        assert got["held"]["w13"] + got["held"]["w2"] == whole_experts // 2
        assert torch.equal(got["w13"], reference.w13.data[4 * rank : 4 * rank + 4])
        assert torch.equal(got["w2"], reference.w2.data[4 * rank : 4 * rank + 4])
        assert got["held"]["gate"] == reference.gate.numel()
        for pname, param in reference.named_parameters():
            if pname.startswith(("shared_experts.", "correction_bias")):
                assert got["held"][pname] == param.numel(), pname
        assert not got["touched"]  # another rank's experts were never read
        assert got["phases"] == sorted(("moe.route", "moe.dispatch", "moe.experts", "moe.combine", "moe.gather"))


def test_experts_and_tokens_are_dealt_contiguously() -> None:
    assert [ExpertParallel(rank, 4).local_experts(8) for rank in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    # tokens as even as they go; with fewer tokens than ranks, the last ranks have none
    assert [ExpertParallel(rank, 3).token_slice(5) for rank in range(3)] == [(0, 2), (2, 2), (4, 1)]
    assert [ExpertParallel(rank, 3).token_slice(1) for rank in range(3)] == [(0, 1), (1, 0), (1, 0)]
    whole = FusedMoE(CONFIGS["mixtral-softmax"], HIDDEN, ep=ExpertParallel())  # a group of one: unsplit
    assert whole.ep is None and whole.local_expert_range == range(8) and whole.owns_expert(7)
    second = FusedMoE(CONFIGS["mixtral-softmax"], HIDDEN, ep=ExpertParallel(1, 2))
    assert second.local_expert_range == range(4, 8) and not second.owns_expert(3) and second.owns_expert(4)


def test_a_group_that_does_not_divide_the_experts_is_refused() -> None:
    message = "--enable-expert-parallel: expert parallelism over 3 ranks does not divide the model's 8 experts"
    with pytest.raises(ValueError, match=message):
        FusedMoE(CONFIGS["mixtral-softmax"], HIDDEN, ep=ExpertParallel(0, 3))
    with pytest.raises(ValueError, match="expert-parallel rank 2 of 2 is not a valid place"):
        ExpertParallel(2, 2)
