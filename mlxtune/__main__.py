"""``python -m mlxtune``: the mlxtune command."""

import sys

from .cli import main

sys.exit(main())
