"""`python -m snlp ...` (and `torchrun -m snlp train ...`)."""

import sys

from .cli import main

sys.exit(main())
