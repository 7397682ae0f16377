"""``python -m gateway`` — the same entry point as the ``specshadow`` console script."""

from gateway.cli import main

raise SystemExit(main())
