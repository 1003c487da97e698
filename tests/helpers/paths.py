"""The repository's root, computed once here so that a test file's depth under tests/ does not matter."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
