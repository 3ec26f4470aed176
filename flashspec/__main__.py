"""``python -m flashspec ...`` runs the ``flashspec`` command (e.g. under ``torchrun -m flashspec bench tp``)."""

import sys

from .cli import main

sys.exit(main())
