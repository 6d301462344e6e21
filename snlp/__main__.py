"""`python -m snlp ...` (and `torchrun -m snlp train ...`)."""

import sys

from snlp.apps.cli import main

sys.exit(main())
