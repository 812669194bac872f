"""`tandem spec ...`: tools for speculative decoding (training draft heads).

Only the parser lives here, torch-free, so `tandem --help` and `tandem route` stay light; the
handler imports the trainer when it runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

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


def add_spec_parser(subparsers: argparse._SubParsersAction) -> None:
    spec = subparsers.add_parser("spec", help="speculative decoding tools (train an EAGLE-3 head)",
                                 description="Tools for speculative decoding.")
    commands = spec.add_subparsers(dest="spec_command", required=True, metavar="SPEC")
    train = commands.add_parser("train-eagle3", help="train an EAGLE-3 draft head for a model on its own outputs",
                                description=_TRAIN_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("model", nargs="?", default=None, metavar="MODEL",
                       help="target: HF directory, .gguf or alias (default: smollm2-135m)")
    train.add_argument("-o", "--output", type=Path, metavar="DIR", required=True, help="directory for the head")

    data = train.add_argument_group("data")
    data.add_argument("--prompts", type=Path, default=None, metavar="FILE",
                      help='extra conversations, JSONL: {"messages": [...]}, {"prompt": "..."} or a string')
    data.add_argument("--no-builtin-prompts", action="store_true", help="use only --prompts")
    data.add_argument("--max-prompts", type=int, metavar="N", default=None, help="use the first N conversations")
    data.add_argument("--max-new-tokens", type=int, metavar="N", default=192, help="continuation length (default: 192)")
    data.add_argument("--sampled-fraction", type=float, metavar="F", default=0.3,
                      help="conversations that also get a sampled continuation (default: 0.3)")
    data.add_argument("--gen-minutes", type=float, metavar="M", default=None,
                      help="start no generation round (32 conversations, run whole) that would end "
                           "after M minutes (default: no limit)")
    data.add_argument("--samples-cache", type=Path, metavar="FILE", default=None,
                      help="JSONL of the target's continuations: reused, extended for conversations it "
                           "lacks, rewritten (resume a cut run, re-train without generating)")
    data.add_argument("--draft-vocab-size", type=int, metavar="N", default=8192,
                      help="the head's vocabulary: the most frequent generated tokens (default: 8192)")
    data.add_argument("--heldout-fraction", type=float, metavar="F", default=0.1,
                      help="conversations kept out of training for the report (default: 0.1)")

    fit = train.add_argument_group("training")
    fit.add_argument("--minutes", type=float, metavar="M", default=45.0, help="training time budget (default: 45)")
    fit.add_argument("--steps", type=int, metavar="N", default=None, help="stop after this many optimizer steps")
    fit.add_argument("--ttt-steps", type=int, metavar="N", default=4, help="guesses unrolled per training row (default: 4)")
    fit.add_argument("--eval-steps", type=int, metavar="N", default=5, help="guesses unrolled in the report (default: 5)")
    fit.add_argument("--batch-tokens", type=int, metavar="N", default=1024, help="rows per optimizer step (default: 1024)")
    fit.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                     help="training matmuls; auto: bf16 where the CPU multiplies it natively (default: auto)")
    fit.add_argument("--lr", type=float, metavar="LR", default=1e-3, help="peak AdamW learning rate (default: 1e-3)")
    fit.add_argument("--weight-decay", type=float, metavar="W", default=0.01, help="AdamW weight decay (default: 0.01)")
    fit.add_argument("--feature-loss", type=float, metavar="W", default=0.0,
                     help="weight of a regression onto the target's last hidden state (EAGLE-1's feature "
                          "loss; default: 0, cross-entropy only)")
    fit.add_argument("--train-lm-head", action="store_true",
                     help="train the final norm and LM head too (default: kept as the target's rows)")
    fit.add_argument("--seed", type=int, metavar="N", default=0)
    fit.add_argument("--threads", type=int, metavar="N", default=None, help="torch threads (default: torch's)")
    fit.add_argument("--no-progress", action="store_true", help="no progress bars")
    train.set_defaults(handler=cmd_train_eagle3)


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
