"""``python -m statekv``: the ``statekv`` command, for an environment whose scripts are not on the PATH."""

import sys

from .cli import main

sys.exit(main())
