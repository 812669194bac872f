"""`tandem spec ...`: tools for speculative decoding (training draft heads).

Only the parser lives here, torch-free, so `tandem --help` and `tandem route` stay light; the
handler imports the trainer when it runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tandem.flags.table import Command, Flag, FlagTable

_TRAIN_DESCRIPTION = """\
Fit an EAGLE-3 draft head for MODEL by self-distillation: the target continues built-in
conversations (agent tool calls, code tasks, prose; plus --prompts) through tandem, transformers
records its aux hidden states and next-token distributions, and a one-layer head learns to
predict them with EAGLE-3's training-time test (several guesses unrolled, each fed the head's
own output). Writes the HF EAGLE-3 layout (config.json, model.safetensors with d2t/t2d, no
embedding: the target's is shared) and prints the held-out per-step top-1 agreement, the
acceptance proxy.

Runs on CPU; --minutes bounds the training loop, --gen-minutes the data generation before it.
"""


# The target and where its head goes, outside any group.
TRAIN_TARGET_FLAGS = FlagTable(None, (
    Flag(
        "model", metavar="MODEL", nargs="?",
        help="target: HF directory, .gguf or alias (default: smollm2-135m)",
    ),
    Flag(
        "--output", type=Path, metavar="DIR", short="-o", required=True,
        help="directory for the head",
    ),
))
# What the head learns from: the conversations and the target's continuations of them.
TRAIN_DATA_FLAGS = FlagTable("data", (
    Flag(
        "--prompts", type=Path, metavar="FILE",
        help='extra conversations, JSONL: {"messages": [...]}, {"prompt": "..."} or a string',
    ),
    Flag("--no-builtin-prompts", switch=True, help="use only --prompts"),
    Flag("--max-prompts", type=int, metavar="N", help="use the first N conversations"),
    Flag(
        "--max-new-tokens", default=192, type=int, metavar="N",
        help="continuation length (default: 192)",
    ),
    Flag(
        "--sampled-fraction", default=0.3, type=float, metavar="F",
        help="conversations that also get a sampled continuation (default: 0.3)",
    ),
    Flag(
        "--gen-minutes", type=float, metavar="M",
        help="start no generation round (32 conversations, run whole) that would end "
        "after M minutes (default: no limit)",
    ),
    Flag(
        "--samples-cache", type=Path, metavar="FILE",
        help="JSONL of the target's continuations: reused, extended for conversations it "
        "lacks, rewritten (resume a cut run, re-train without generating)",
    ),
    Flag(
        "--draft-vocab-size", default=8192, type=int, metavar="N",
        help="the head's vocabulary: the most frequent generated tokens (default: 8192)",
    ),
    Flag(
        "--heldout-fraction", default=0.1, type=float, metavar="F",
        help="conversations kept out of training for the report (default: 0.1)",
    ),
))
# How the head is fitted (TrainOptions' optimizer and budget fields).
TRAIN_FIT_FLAGS = FlagTable("training", (
    Flag(
        "--minutes", default=45.0, type=float, metavar="M",
        help="training time budget (default: 45)",
    ),
    Flag("--steps", type=int, metavar="N", help="stop after this many optimizer steps"),
    Flag(
        "--ttt-steps", default=4, type=int, metavar="N",
        help="guesses unrolled per training row (default: 4)",
    ),
    Flag(
        "--eval-steps", default=5, type=int, metavar="N",
        help="guesses unrolled in the report (default: 5)",
    ),
    Flag(
        "--batch-tokens", default=1024, type=int, metavar="N",
        help="rows per optimizer step (default: 1024)",
    ),
    Flag(
        "--precision", default="auto", choices=("auto", "bf16", "fp32"),
        help="training matmuls; auto: bf16 where the CPU multiplies it natively (default: auto)",
    ),
    Flag(
        "--lr", default=1e-3, type=float, metavar="LR",
        help="peak AdamW learning rate (default: 1e-3)",
    ),
    Flag(
        "--weight-decay", default=0.01, type=float, metavar="W",
        help="AdamW weight decay (default: 0.01)",
    ),
    Flag(
        "--feature-loss", default=0.0, type=float, metavar="W",
        help="weight of a regression onto the target's last hidden state (EAGLE-1's feature "
        "loss; default: 0, cross-entropy only)",
    ),
    Flag(
        "--train-lm-head", switch=True,
        help="train the final norm and LM head too (default: kept as the target's rows)",
    ),
    Flag("--seed", default=0, type=int, metavar="N"),
    Flag("--threads", type=int, metavar="N", help="torch threads (default: torch's)"),
    Flag("--no-progress", switch=True, help="no progress bars"),
))


def add_spec_parser(subparsers: argparse._SubParsersAction) -> None:
    spec = subparsers.add_parser("spec", help="speculative decoding tools (train an EAGLE-3 head)",
                                 description="Tools for speculative decoding.")
    commands = spec.add_subparsers(dest="spec_command", required=True, metavar="SPEC")
    train = commands.add_parser("train-eagle3", help="train an EAGLE-3 draft head for a model on its own outputs",
                                description=_TRAIN_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    for table in (TRAIN_TARGET_FLAGS, TRAIN_DATA_FLAGS, TRAIN_FIT_FLAGS):
        table.add_to(train)
    Command(cmd_train_eagle3).install(train)


def cmd_train_eagle3(args: argparse.Namespace) -> int:
    from tandem.train.eagle3 import TrainOptions, format_report, run

    opts = TrainOptions(
        model=args.model, output=args.output, prompts_file=args.prompts,
        use_builtin_prompts=not args.no_builtin_prompts, max_prompts=args.max_prompts,
        max_new_tokens=args.max_new_tokens, sampled_fraction=args.sampled_fraction, gen_minutes=args.gen_minutes,
        samples_cache=args.samples_cache,
        draft_vocab_size=args.draft_vocab_size, heldout_fraction=args.heldout_fraction, minutes=args.minutes,
        steps=args.steps, ttt_steps=args.ttt_steps, eval_steps=args.eval_steps, batch_tokens=args.batch_tokens,
        lr=args.lr, weight_decay=args.weight_decay, train_lm_head=args.train_lm_head,
        feature_loss=args.feature_loss, precision=args.precision, seed=args.seed, threads=args.threads, progress=not args.no_progress,
    )
    report = run(opts)
    print(format_report(report))
    print(f"head written to {args.output}")
    return 0
