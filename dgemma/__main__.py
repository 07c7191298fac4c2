"""`python -m dgemma ...` is the same as the `dgemma` console script."""

from dgemma.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
