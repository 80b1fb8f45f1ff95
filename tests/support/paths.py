"""Where the repository and the test fixtures are, for tests at any depth under tests/."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
FIXTURES = REPO_ROOT / "tests" / "fixtures"
