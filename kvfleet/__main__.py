"""`python -m kvfleet` is the same command line as the `kvfleet` console script."""

from kvfleet.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
