import sys

from forgerl.cli import main

sys.exit(main())
