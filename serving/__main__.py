"""``python -m polyengine.serving``: the same command as ``polyengine serve``."""

import sys

from polyengine.serving.cli import main

sys.exit(main())
