"""Print the command marked ``<!-- ci: NAME -->`` (the fenced block right below the marker) in README.md, or in
the docs page given as a second argument.

CI runs exactly what the README prints, so the two cannot drift.
"""

import re
import sys
from pathlib import Path

name = sys.argv[1]
page = sys.argv[2] if len(sys.argv) > 2 else "README.md"
text = (Path(__file__).resolve().parents[1] / page).read_text()
match = re.search(rf"<!-- ci: {re.escape(name)} -->\s*```bash\n(.*?)```", text, re.S)
if not match:
    sys.exit(f"{page} has no command marked <!-- ci: {name} -->")
print(match.group(1).strip())
