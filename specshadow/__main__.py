"""``python -m specshadow`` — the same entry point as the ``specshadow`` console script."""

from specshadow.main import main

raise SystemExit(main())
