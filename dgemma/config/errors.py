"""`ConfigError`, the one exception of the config system (its own module so that the YAML reader and the typed
construction both use it without importing each other)."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """One or more configuration errors; `errors` lists them (each starts with the dotted path)."""

    def __init__(self, errors: str | list[str]):
        self.errors = [errors] if isinstance(errors, str) else list(errors)
        msg = self.errors[0] if len(self.errors) == 1 else "\n  " + "\n  ".join(self.errors)
        super().__init__(f"invalid config: {msg}")
