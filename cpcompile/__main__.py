"""The ``cpcompile`` command (also ``python -m cpcompile``). Subcommand: ``inspect``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from cpcompile.layouts import DEFAULT_BLOCK_SIZE, DEFAULT_LAYOUT, LAYOUTS
from cpcompile.options import ATTENTION_PATHS
from cpcompile.runtime.shard_options import RECURRENCES

_INSPECT_HELP = """\
Trace a model as every rank of a CP group, in this one process (a fake process group: no cluster, no GPU,
and by default no weights: the model lives on the meta device), and print one row per SDPA site: graph,
layer, q/k/v shapes and dtype, query/KV heads, the mask form found, what the backend does (rewritten, or
refused and why) and the bytes each rank all-gathers per call and per step (and reduce-scatters in backward).

With --dump DIR (a new or empty folder) it also writes, byte-identically for the same arguments:
  DIR/summary.json               settings, every site row of every traced rank, per-rank totals, file list
  DIR/attention_pattern.png      which (query, key) pairs each rank computes under the plan, one panel per
                                 batch row, rows coloured by rank (panel of about 512 px per side)
  DIR/rank{r}/graph{n}_before.py graph n as Dynamo traced it for rank r (runnable print_readable code)
  DIR/rank{r}/graph{n}_after.py  the same graph after the cpcompile pass
  DIR/rank{r}/summary.json       what the pass did in rank r's graphs

The same per-rank files come from a real multi-process run with CPCOMPILE_DUMP_DIR=DIR set (or
cpcompile.backend(group, dump_dir=DIR)).

Exit status: 0 when the report was printed (also when sites are refused or the model has no SDPA),
2 for arguments that cannot work (unknown model, a CP size that does not fit), 1 when tracing fails.
"""


def _doc_row(text: str) -> list[int]:
    try:
        row = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of document lengths, e.g. 10,20,34"
        ) from None
    if not row or any(n < 1 for n in row):
        raise argparse.ArgumentTypeError(f"{text!r}: document lengths must be positive integers, e.g. 10,20,34")
    return row


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cpcompile", description="cpcompile command-line tools")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "inspect",
        help="show every SDPA site of a model, what the backend makes of it and what it costs per rank",
        description=_INSPECT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "model", help="a transformers config.json (or the folder holding it), or module:factory returning the model"
    )
    p.add_argument("--cp-size", "--cp", type=int, required=True, help="CP group size N")
    p.add_argument("--seq-len", type=int, required=True, help="global sequence length T of a batch row")
    p.add_argument(
        "--docs",
        type=_doc_row,
        action="append",
        metavar="L1,L2,...",
        help="packed document lengths of one batch row, summing to --seq-len; repeat for more rows "
        "(default: --batch-size rows of one document)",
    )
    p.add_argument("--batch-size", type=int, default=1, help="rows when --docs is not given (default 1)")
    p.add_argument(
        "--rank", type=int, action="append", dest="ranks", help="trace only this rank (repeatable; default all)"
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="cast the model (default: as built)")
    p.add_argument(
        "--device",
        choices=["meta", "cpu"],
        default="meta",
        help="meta (default): shapes only; cpu: real tensors, for models whose code reads values",
    )
    p.add_argument("--attn-implementation", default="sdpa", help="for config files (default sdpa)")
    p.add_argument(
        "--attention",
        choices=ATTENTION_PATHS,
        default="auto",
        help="the backend's attention option (default auto: the block loop on every device)",
    )
    p.add_argument(
        "--layout",
        choices=sorted(LAYOUTS),
        default=DEFAULT_LAYOUT,
        help=f"shard's layout (default {DEFAULT_LAYOUT}: every rank computes the same attention work)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=DEFAULT_BLOCK_SIZE,
        help="the backend's block_size: blocks of the computed-pairs column and of the balanced layout "
        f"(default {DEFAULT_BLOCK_SIZE})",
    )
    p.add_argument(
        "--recurrence",
        choices=RECURRENCES,
        default="heads",
        help="shard's recurrence: how the gated delta rule, the SSD and the RG-LRU run (default heads: "
        "head-parallel; state: state passing)",
    )
    p.add_argument(
        "--no-config",
        dest="use_config",
        action="store_false",
        help="do not pass the model's transformers config to the backend (training should pass it: windows and "
        "refusals that come from the config then show)",
    )
    p.add_argument("--dump", metavar="DIR", help="write graphs, summary.json and attention_pattern.png to DIR")
    p.set_defaults(run=_inspect, subparser=p)
    return parser


def _inspect(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from cpcompile.inspect import inspect_model, write_dump

    if args.dump is not None:
        if os.path.isdir(args.dump) and os.listdir(args.dump):
            parser.error(f"--dump {args.dump}: the folder is not empty; pass a new or empty folder")
    try:
        result = inspect_model(
            args.model,
            cp_size=args.cp_size,
            seq_len=args.seq_len,
            doc_lens=args.docs,
            batch_size=args.batch_size,
            ranks=args.ranks,
            dtype=args.dtype,
            device=args.device,
            attn_implementation=args.attn_implementation,
            attention=args.attention,
            layout=args.layout,
            block_size=args.block_size,
            use_config=args.use_config,
            recurrence=args.recurrence,
        )
    except ValueError as e:
        parser.error(str(e))
    except RuntimeError as e:
        print(f"cpcompile inspect: error: {e}", file=sys.stderr)
        return 1
    sys.stdout.write(result.report())
    if args.dump is not None:
        paths = write_dump(result, args.dump)
        print(f"\nwrote {len(paths)} files to {args.dump}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``cpcompile`` command; returns the exit status (argument errors exit 2 via argparse)."""
    args = build_parser().parse_args(argv)
    return args.run(args, args.subparser)


if __name__ == "__main__":
    sys.exit(main())
