"""The `forgerl` console script.

    forgerl train CONFIG [--section.key VALUE ...]     run (or resume) RL training
    forgerl gateway CONFIG [--section.key VALUE ...]   serve the policy for external agents
    forgerl plot RUN_DIR                               write RUN_DIR/curves.png

Bad input gives a one-line error and exit code 2. Heavy imports (torch) happen after parsing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from forgerl.config import ConfigError, load_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="forgerl", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("train", "run or resume RL training"), ("gateway", "serve the policy")):
        p = sub.add_parser(name, help=text, description=text + "; overrides: --section.key VALUE")
        p.add_argument("config", help="TOML config file")
    plot = sub.add_parser("plot", help="plot reward and held-out accuracy of a run")
    plot.add_argument("run_dir")
    plot.add_argument("--out", default=None, help="PNG path (default RUN_DIR/curves.png)")
    return parser


def _fail(message: str) -> int:
    print(f"forgerl: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code (0 ok, 2 bad input, 130 interrupted)."""
    args, rest = _parser().parse_known_args(argv)
    try:
        if args.command == "plot":
            if rest:
                return _fail(f"unexpected arguments: {' '.join(rest)}")
            from forgerl.plot import plot_run

            print(plot_run(args.run_dir, args.out))
            return 0
        config = load_config(args.config, rest)
        from transformers.utils import logging as hf_logging

        from forgerl.controller import run, serve_gateway

        hf_logging.disable_progress_bar()  # the run draws its own; no per-checkpoint bars

        asyncio.run(run(config) if args.command == "train" else serve_gateway(config))
        return 0
    except ConfigError as e:
        return _fail(str(e))
    except (FileNotFoundError, ValueError) as e:
        return _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    except KeyboardInterrupt:
        print("forgerl: interrupted" + (
            "; re-run the same command to resume" if args.command == "train" else ""),
            file=sys.stderr)
        return 130
    except Exception as e:  # one line for the user; FORGERL_LOG=debug shows the traceback
        if os.environ.get("FORGERL_LOG") == "debug":
            raise
        print(f"forgerl: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
