"""What `python -m adaln_lab` runs in the folder that holds the clone: there Python finds the clone's own folder
(named adaln_lab, with no __init__.py) before the package inside it, takes it for an empty namespace package and
looks for its __main__ here. Say so in one line and exit 2, instead of Python's "No module named
adaln_lab.__main__". (`import adaln_lab` from that folder gets the same empty package, and no code of this
project runs for it to explain.)"""

import os
import sys

clone = os.path.dirname(os.path.abspath(__file__))
print(f"python -m adaln_lab: error: from {os.getcwd()}, 'adaln_lab' is the folder {clone} itself (the clone: no "
      f"__init__.py, so Python takes it for an empty namespace package), not the package inside it; run from the "
      f"clone's root (cd {os.path.relpath(clone)}) or, after `pip install -e {os.path.relpath(clone)}`, from any "
      "other folder", file=sys.stderr)
sys.exit(2)
