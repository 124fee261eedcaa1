"""Writes the docs' generated tables from their one definition: the settings table from
torch_torus/config.py and the algorithm catalog from the C++ catalog (torch_torus.algorithms).

    python docs/generate_tables.py           # rewrite the tables in place
    python docs/generate_tables.py --check   # exit 1, naming the page, where one is stale

Each table sits between `<!-- NAME-table: ... -->` and `<!-- end NAME-table -->` in its page;
tests/test_docs.py runs the check.
"""

import argparse
import pathlib
import re
import sys

DOCS = pathlib.Path(__file__).resolve().parent


def tables():
    """{(page, marker name): the table's markdown}."""
    from torch_torus import algorithms, config

    return {("algorithms.md", "settings"): config.markdown_table(),
            ("algorithms.md", "catalog"): algorithms.markdown_table()}


def render(text, name, table):
    """`text` with the block named `name` replaced by `table`; ValueError if it has no such block."""
    pattern = re.compile(r"(<!-- %s-table:[^\n]*-->\n)(.*?)(<!-- end %s-table -->)" % (name, name), re.S)
    if not pattern.search(text):
        raise ValueError(f"no '<!-- {name}-table: ... -->' ... '<!-- end {name}-table -->' block")
    return pattern.sub(lambda m: m.group(1) + table.strip() + "\n" + m.group(3), text, count=1)


def stale_pages():
    """The pages whose generated tables differ from their definitions, rewritten: {path: text}."""
    rewritten = {}
    for (page, name), table in tables().items():
        path = DOCS / page
        text = rewritten.get(path, path.read_text())
        rewritten[path] = render(text, name, table)
    return {path: text for path, text in rewritten.items() if text != path.read_text()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only say which pages are stale")
    args = parser.parse_args(argv)
    stale = stale_pages()
    for path, text in stale.items():
        if args.check:
            print(f"{path}: generated table out of date; run python docs/generate_tables.py")
        else:
            path.write_text(text)
            print(f"{path}: rewritten")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.path.insert(0, str(DOCS.parent))
    sys.exit(main())
