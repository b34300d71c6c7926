"""The ``lightning-chunk`` console command (also ``python -m lightning_chunk``).

    lightning-chunk consolidate CKPT_DIR OUT [--with-optimizer] [--no-progress]
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from .engine.checkpoint import CheckpointError, consolidate


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-chunk", description="Tools for lightning_chunk checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="write a sharded checkpoint directory as one plain checkpoint file",
                       description="Stream a sharded checkpoint directory, chunk by chunk, into one plain Lightning "
                                   "checkpoint file whose 'state_dict' model.load_state_dict accepts.")
    c.add_argument("checkpoint", help="the sharded checkpoint directory (NAME.ckpt)")
    c.add_argument("out", help="the file to write")
    c.add_argument("--with-optimizer", action="store_true", help="keep the optimizer state (plain format)")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "consolidate":
        try:
            out = consolidate(args.checkpoint, args.out, with_optimizer=args.with_optimizer,
                              progress=not args.no_progress)
        except CheckpointError as e:
            print(f"lightning-chunk: error: {e}", file=sys.stderr)
            return 2
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
