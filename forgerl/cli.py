"""The `forgerl` console script.

    forgerl train CONFIG [--section.key VALUE ...]     run (or resume) RL training
    forgerl gateway CONFIG [--section.key VALUE ...]   serve the policy for external agents
    forgerl serve CONFIG [--host H] [--port P] [...]   the Tinker API over LoRA runs, or
                                                       with [online]: serve users, train online
    forgerl plot RUN_DIR                               write RUN_DIR/curves.png

Bad input gives a one-line error and exit code 2. Heavy imports (torch) happen after parsing.
SIGINT, SIGTERM and SIGHUP stop a run the same way, whatever dispositions or signal mask the
process inherited (e.g. SIGINT ignored under `nohup`): the first cancels the run (no new
rollouts, agents' process groups killed, engine closed, exit 128 + signal number with one
line); a second exits at once, and the run's reaper kills the agents.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Coroutine
from typing import Any

from forgerl.config import Config, load_config
from forgerl.controller import run, serve_gateway, share_malloc_arena
from forgerl.plot import plot_run


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="forgerl", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("train", "run or resume RL training"), ("gateway", "serve the policy")):
        p = sub.add_parser(name, help=text, description=text + "; overrides: --section.key VALUE")
        p.add_argument("config", help="TOML config file")
    serve = sub.add_parser(
        "serve", help="the Tinker API over LoRA runs on one base; [online]: train on served users")
    serve.add_argument("config", help="TOML config file")
    serve.add_argument("--host", default=None, help="listen address (default [serve] host)")
    serve.add_argument("--port", type=int, default=None, help="port (default [serve] port)")
    plot = sub.add_parser("plot", help="plot reward and held-out accuracy of a run")
    plot.add_argument("run_dir")
    plot.add_argument("--out", default=None, help="PNG path (default RUN_DIR/curves.png)")
    return parser


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(Exception):
    """The run was stopped by a signal (`signum`) and has shut down cleanly."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


async def until_signal(coro: Coroutine[Any, Any, Any]) -> Any:
    """Await `coro`; the first of STOP_SIGNALS cancels it and raises Stopped once it has shut
    down; any later one, until the process ends, exits it at once (`os._exit(128 + signum)`).

    Python-level handlers (not the event loop's) so that they also fire while the loop is busy
    in synchronous code such as model loading.
    """
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(coro)
    received: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        received.append(signum)
        for sig in STOP_SIGNALS:  # from now on, until the process ends: exit at once
            signal.signal(sig, _exit_now)
        loop.call_soon_threadsafe(task.cancel)

    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
    try:
        result = await task
    except asyncio.CancelledError:
        if received:
            raise Stopped(received[0]) from None
        raise
    else:
        if received:  # it finished while shutting down
            raise Stopped(received[0])
        return result
    finally:
        if not received:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _exit_now(signum: int, _frame: object) -> None:
    os._exit(128 + signum)  # a second stop signal; the run's reaper kills the agents


def _raise_stopped(signum: int, _frame: object) -> None:
    raise Stopped(signum)


def _serve(config: Config) -> Coroutine[Any, Any, None]:
    """`forgerl serve`: online RL on served traffic with [online] (forgerl/online/serve.py),
    else the Tinker API (forgerl/tinker/)."""
    if config.online is not None:
        from forgerl.online.serve import serve_online  # lazy: torch, after parsing
        return serve_online(config)
    # lazy: the optional extra forgerl[tinker] (the tinker SDK's protobuf messages)
    from forgerl.tinker import serve
    return serve(config)


def _fail(message: str) -> int:
    print(f"forgerl: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code (0 ok, 1 error, 2 bad input, 128 + N stopped
    by signal N: 130 SIGINT, 143 SIGTERM, 129 SIGHUP)."""
    share_malloc_arena()  # before any second thread allocates
    args, rest = _parser().parse_known_args(argv)
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        if args.command != "plot":  # until the run's own handlers take over (`until_signal`)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
            for sig in STOP_SIGNALS:
                signal.signal(sig, _raise_stopped)
        if args.command == "plot":
            if rest:
                return _fail(f"unexpected arguments: {' '.join(rest)}")
            print(plot_run(args.run_dir, args.out))
            return 0
        if args.command == "serve":
            rest += [f"--serve.{k}={v}" for k in ("host", "port")
                     if (v := getattr(args, k)) is not None]
        config = load_config(args.config, rest)
        # the run draws its own bars: none from transformers or the hub per checkpoint (read at
        # their import, which `run` starts only after its task generation is under way)
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

        asyncio.run(until_signal(run(config) if args.command == "train"
                                 else _serve(config) if args.command == "serve"
                                 else serve_gateway(config)))
        return 0
    except Stopped as e:
        previous = dict.fromkeys(STOP_SIGNALS, _exit_now)  # a later signal: exit at once
        print(f"forgerl: stopped by {e}" + (
            "; re-run the same command to resume" if args.command == "train" else ""),
            file=sys.stderr)
        return 128 + e.signum
    except (FileNotFoundError, ValueError) as e:  # ConfigError too: one line naming the field
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
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
