"""`python -m dali_fast`: the command line, as `dali-fast` runs it."""

import sys

from .cli import main

sys.exit(main())
