"""``python -m polyengine``: the ``polyengine`` command."""

import sys

from polyengine.cli import main

sys.exit(main())
