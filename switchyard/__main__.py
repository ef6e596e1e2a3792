"""``python -m switchyard``: the same as the ``switchyard`` command."""

import sys

from switchyard.cli.main import main

sys.exit(main())
