"""The ``lightning-chunk`` console command (also ``python -m lightning_chunk``).

lightning-chunk consolidate CKPT_DIR OUT [--with-optimizer] [--no-progress] [--force]
lightning-chunk consolidate --format hf CKPT_DIR OUT_DIR [--config DIR] [--dtype bfloat16] [--max-shard-size 5GB]
lightning-chunk plan MODEL [--data DATA] [--config YAML] [--device-memory-limit BYTES] ...
lightning-chunk plan MODEL --shapes-only --ranks 8 --init-args '{"width": 4096, "depth": 32}' ...
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .consolidate import consolidate
from .engine.config import parse_bytes
from .engine.state.checkpoint import CheckpointError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-chunk", description="Tools for lightning_chunk checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser(
        "consolidate",
        help="write a sharded checkpoint directory as one plain checkpoint file, or as "
        "a Hugging Face save_pretrained directory",
        description="Stream a sharded checkpoint directory, chunk by chunk, into one plain Lightning "
        "checkpoint file whose 'state_dict' model.load_state_dict accepts (--format "
        "lightning), or into a directory of safetensors shards, their index and "
        "config.json that transformers' from_pretrained loads (--format hf).",
    )
    c.add_argument("checkpoint", help="the sharded checkpoint directory (NAME.ckpt)")
    c.add_argument("out", help="the file to write (lightning), or the new directory (hf)")
    c.add_argument("--format", choices=["lightning", "hf"], default="lightning", help="what to write")
    c.add_argument("--with-optimizer", action="store_true", help="keep the optimizer state (lightning format)")
    c.add_argument("--ema", action="store_true", help="the weights averaged by ChunkEMA instead of the trained ones")
    c.add_argument(
        "--config", help="hf: the model's config.json or its directory (default: the checkpoint's 'hf_config')"
    )
    c.add_argument("--dtype", help="hf: float32, bfloat16 or float16 (default: the parameters' dtype)")
    c.add_argument("--max-shard-size", default="5GB", help="hf: the largest safetensors file (default 5GB)")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    c.add_argument(
        "--force",
        action="store_true",
        help="replace an existing output (once the new one is complete); refused without it",
    )
    p = sub.add_parser(
        "plan",
        help="before training: chunks, bytes per tier and the device peak under a limit",
        description="Run one throwaway warm-up step on one batch and report the chunk layout, the "
        "bytes per tier, and the estimated device peak. Exits 1 when it does not fit.",
    )
    p.add_argument("model", help="the LightningModule: package.module.Class or path/to/file.py:Class")
    p.add_argument("--data", help="its LightningDataModule (same forms), for a sample batch")
    p.add_argument("--config", help="a LightningCLI YAML: its model, data and trainer.strategy sections are used")
    p.add_argument("--init-args", help="model arguments as JSON (over the config's)")
    p.add_argument("--data-args", help="data module arguments as JSON (over the config's)")
    p.add_argument("--device-memory-limit", help="bytes, or a string such as 24GiB")
    p.add_argument("--host-memory-limit", help="bytes, or a string such as 64GiB: shards beyond it go to disk")
    p.add_argument("--disk-dir", help="the disk tier's directory (the dry run writes its scratch files there)")
    p.add_argument("--placement", choices=["auto", "device", "host", "static"])
    p.add_argument("--chunk-numel", type=int)
    p.add_argument("--precision")
    p.add_argument(
        "--shapes-only",
        action="store_true",
        help="build nothing (meta device): per-rank bytes from shapes, for models too large to build here",
    )
    p.add_argument(
        "--ema",
        action="store_true",
        help="count a ChunkEMA's average (as a --config whose trainer.callbacks hold one does)",
    )
    p.add_argument(
        "--async-save",
        action="store_true",
        help="with --nodes: saves written in the background, beside training (as a --config whose trainer.plugins "
        "hold AsyncCheckpointIO makes them)",
    )
    p.add_argument("--ranks", type=int, default=1, help="with --shapes-only: the number of ranks to plan for")
    p.add_argument(
        "--nodes",
        type=int,
        help="a cluster to plan for from shapes: its nodes (with --devices); prints "
        "each phase's peak device and host bytes a rank and a node",
    )
    p.add_argument("--devices", type=int, help="the cluster's devices (ranks) a node")
    p.add_argument(
        "--shard-size",
        help="with --nodes: shard each chunk over this many ranks ('node': a node's devices), replicated across groups",
    )
    p.add_argument("--device-memory", help="each device's memory, e.g. 80GiB (the limit leaves the default margin)")
    p.add_argument("--host-memory", help="each node's host memory, e.g. 1TiB")
    p.add_argument(
        "--activations",
        help="with --nodes: a step's activation peak a rank, e.g. 6GiB (a real run's "
        "plan prints it), added to the steps' device bytes",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "consolidate":
        try:
            out = _consolidate(args)
        except (CheckpointError, ValueError) as e:
            print(f"lightning-chunk: error: {e}", file=sys.stderr)
            return 2
        print(f"wrote {out}")
    if args.command == "plan":
        return _plan(args)
    return 0


def _consolidate(args: argparse.Namespace) -> object:
    if args.format == "lightning":
        extra = [f"--{n}" for n in ("config", "dtype") if getattr(args, n) is not None]
        if extra:
            raise ValueError(f"{', '.join(extra)} apply to --format hf only.")
        return consolidate(
            args.checkpoint,
            args.out,
            with_optimizer=args.with_optimizer,
            progress=not args.no_progress,
            ema=args.ema,
            force=args.force,
        )
    if args.with_optimizer:
        raise ValueError(
            "--with-optimizer applies to --format lightning only: a save_pretrained directory holds weights."
        )
    try:
        import transformers  # noqa: F401

        from .hf import export_hf
    except ImportError:
        raise ValueError("--format hf needs transformers: pip install 'lightning_chunk[hf]'.") from None
    return export_hf(
        args.checkpoint,
        args.out,
        config=args.config,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        progress=not args.no_progress,
        ema=args.ema,
        force=args.force,
    )


def _plan(args: argparse.Namespace) -> int:
    from .engine.errors import ChunkError
    from .plan import plan_from_args

    overrides = {
        "device_memory_limit": args.device_memory_limit,
        "placement": args.placement,
        "chunk_numel": args.chunk_numel,
        "host_memory_limit": args.host_memory_limit,
        "disk_dir": args.disk_dir,
        "shard_size": int(args.shard_size) if args.shard_size and args.shard_size.isdigit() else args.shard_size,
    }
    try:
        cluster = None
        if args.nodes is not None or args.devices is not None:
            cluster = (
                1 if args.nodes is None else args.nodes,  # 0 is refused, not taken for "not given"
                1 if args.devices is None else args.devices,
                parse_bytes(args.device_memory, field="--device-memory"),
                parse_bytes(args.host_memory, field="--host-memory"),
            )
        elif args.device_memory is not None or args.host_memory is not None or args.activations is not None:
            raise ValueError(
                "--device-memory, --host-memory and --activations describe a cluster: give --nodes and --devices too."
            )
        report = plan_from_args(
            args.model,
            args.data,
            args.config,
            args.init_args,
            args.data_args,
            overrides,
            args.precision,
            shapes_only=args.shapes_only,
            ranks=args.ranks,
            cluster=cluster,
            activations=parse_bytes(args.activations, field="--activations"),
            ema=args.ema,
            background_save=args.async_save,
        )
    except ChunkError as e:
        print(f"lightning-chunk plan: does not fit: {e}", file=sys.stderr)
        return 1
    except (ValueError, TypeError, OSError) as e:
        print(f"lightning-chunk plan: error: {e}", file=sys.stderr)
        return 2
    print(report.render())
    return 0 if report.fits else 1


if __name__ == "__main__":
    sys.exit(main())
