"""Print ``PAGE NAME`` for every command marked ``<!-- ci: NAME -->`` in the getting-started pages of the docs.

CI runs each (after the README's), so the commands a new user copies from those pages are the ones that run.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for page in sorted((ROOT / "docs" / "getting-started").glob("*.md")):
    for name in re.findall(r"<!-- ci: (\S+) -->\s*```bash\n", page.read_text()):
        print(page.relative_to(ROOT), name)
