"""Write the generated reference pages of the docs from the declarations the proxy parses.

    .venv/bin/python docs/gen_options.py            # rewrite them (``make docs`` does)
    .venv/bin/python docs/gen_options.py --check    # exit 1 when a page is out of date

``docs/options.md``: every option's flag, environment variable, TOML key, default and help,
from its one declaration (``proxy.config.options_markdown``). ``docs/backends.md``: each
dialect's capabilities (``proxy.backends.capabilities_markdown``). The pages are generated,
never edited by hand, so they cannot drift from what ``prefixgate serve`` accepts and does.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from proxy.backends import capabilities_markdown  # noqa: E402 (after the path is set)
from proxy.config import options_markdown  # noqa: E402

PAGES = {
    ROOT / "docs" / "options.md": options_markdown,
    ROOT / "docs" / "backends.md": capabilities_markdown,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when a page is out of date")
    args = parser.parse_args(argv)
    stale = 0
    for page, render in PAGES.items():
        text = render()
        name = page.relative_to(ROOT)
        if args.check:
            if not page.is_file() or page.read_text() != text:
                print(f"{name} is out of date: run make docs", file=sys.stderr)
                stale += 1
            continue
        page.write_text(text)
        print(f"wrote {name}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
