"""`python -m forgerl`: stop signals are handled from the first line (before any import), so a
run stopped while it starts exits with 128 + N and one line, never a traceback."""
import signal
import sys


def _stopped_while_starting(signum: int, _frame: object) -> None:
    sys.stderr.write(f"forgerl: stopped by {signal.Signals(signum).name} while starting\n")
    raise SystemExit(128 + signum)


for _sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(_sig, _stopped_while_starting)

import atexit  # noqa: E402
import os  # noqa: E402

from forgerl.cli import main  # noqa: E402  (after the handlers, on purpose)

code = main()  # every file, process and thread the run owns is closed or joined by now
# The interpreter's own teardown with torch and transformers loaded takes 1.5-2 s (measured):
# run the exit hooks (multiprocessing's, logging's), flush, and leave without it.
atexit._run_exitfuncs()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
