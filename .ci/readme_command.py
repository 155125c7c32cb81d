"""Print the README command marked ``<!-- ci: NAME -->`` (the fenced block right below the marker).

CI runs exactly what the README prints, so the two cannot drift.
"""

import re
import sys
from pathlib import Path

name = sys.argv[1]
text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
match = re.search(rf"<!-- ci: {re.escape(name)} -->\s*```bash\n(.*?)```", text, re.S)
if not match:
    sys.exit(f"README.md has no command marked <!-- ci: {name} -->")
print(match.group(1).strip())
