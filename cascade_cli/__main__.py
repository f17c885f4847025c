"""``python -m cascade_cli`` is the ``cascade`` command."""

import sys

from cascade_cli.main import main

sys.exit(main())
