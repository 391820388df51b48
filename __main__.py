"""What `python -m adaln_lab` runs in the folder that holds the clone when no adaln_lab package can be imported
(the clone is not installed, or `python -S`): Python then takes the clone's own folder (named adaln_lab, with no
__init__.py) for an empty namespace package and looks for its __main__ here. Say so in one line and exit 2, instead
of Python's "No module named adaln_lab.__main__". Once the clone is installed (`pip install -e .` puts its src/ on
sys.path), the package in src/adaln_lab/ wins over the namespace package in that folder too, for `import
adaln_lab` as well, and this file never runs."""

import os
import sys

clone = os.path.dirname(os.path.abspath(__file__))
shown = os.path.relpath(clone)
print(f"python -m adaln_lab: error: from {os.getcwd()}, 'adaln_lab' is the folder {clone} itself (the clone: no "
      f"__init__.py, so Python takes it for an empty namespace package), not the package inside it, src/adaln_lab/, "
      f"which is not on this Python's path; install the clone (`pip install -e {shown}`: then it runs from any folder, "
      f"this one included) or put its src/ on the path (PYTHONPATH={os.path.join(shown, 'src')})", file=sys.stderr)
sys.exit(2)
