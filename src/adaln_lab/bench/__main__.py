"""`python -m adaln_lab.bench STEP ... --out DIR [--base REV|DIR]`: the evidence runner (adaln_lab.bench.runner)."""

import sys

from .runner import main

sys.exit(main())
