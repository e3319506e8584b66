"""``python -m analyzers PATH…``: the same as ``prefixgate analyze PATH…``."""

from analyzers.cli import main

raise SystemExit(main())
