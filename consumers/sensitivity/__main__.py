"""``python -m consumers.sensitivity``: the ``worldtap-sensitivity`` command."""

import sys

from .cli import main

sys.exit(main())
