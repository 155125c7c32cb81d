"""generators/ and learners/ never import each other; both stand on asyncrl/ and buffers/."""

import ast

import pytest

from conftest import ROOT


def imported_packages(package: str) -> set[str]:
    found = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("package, forbidden", [("generators", "learners"), ("learners", "generators"),
                                                ("asyncrl", "learners"), ("asyncrl", "generators"),
                                                ("buffers", "learners"), ("buffers", "generators")])
def test_no_cross_imports(package, forbidden):
    assert forbidden not in imported_packages(package)
