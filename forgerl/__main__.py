"""`python -m forgerl`: stop signals are handled from the first line (before any import), so a
run stopped while it starts exits with 128 + N and one line, never a traceback."""
import signal
import sys


def _stopped_while_starting(signum: int, _frame: object) -> None:
    sys.stderr.write(f"forgerl: stopped by {signal.Signals(signum).name} while starting\n")
    raise SystemExit(128 + signum)


for _sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(_sig, _stopped_while_starting)

from forgerl.cli import main  # noqa: E402  (after the handlers, on purpose)

sys.exit(main())
