"""``python -m tiekit``: the ``tiekit`` command, for environments whose scripts folder is not on PATH."""

import sys

from tiekit.cli import main

sys.exit(main())
