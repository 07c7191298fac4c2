"""Helpers shared by the test files (imported as `from support import ...`; tests/ is on sys.path through the rootdir conftest)."""
