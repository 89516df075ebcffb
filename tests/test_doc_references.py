"""The docs, the report and the GPU script name tests by file and name (`FILE.py::NAME`);
each must be a test that exists, so a renamed or moved test leaves no dead pointer."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = re.compile(r"(test_\w+\.py)::\s*\n?\s*(\w+)")


def referring_files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md")),
            ROOT / "benchmarks" / "gpu_all.sh", *sorted((ROOT / "tests").rglob("*.py"))]


def test_every_named_test_exists():
    tests = {p.name: p.read_text() for p in (ROOT / "tests").rglob("test_*.py")}
    dead, seen = [], 0
    for doc in referring_files():
        for file, name in REFERENCE.findall(doc.read_text()):
            seen += 1
            if file not in tests or not re.search(rf"^def {name}\b", tests[file], re.M):
                dead.append(f"{doc.relative_to(ROOT)}: {file}::{name}")
    assert seen > 10, "the pattern no longer finds the docs' test names"
    assert not dead, "named tests that do not exist: " + "; ".join(dead)
