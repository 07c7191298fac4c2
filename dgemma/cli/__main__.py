"""`python -m dgemma.cli ...` is the same as `dgemma ...`."""

from dgemma.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
