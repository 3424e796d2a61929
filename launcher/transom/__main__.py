"""`python -m transom` is the `transom` console script."""

from transom.cli import main

raise SystemExit(main())
