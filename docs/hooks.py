"""mkdocs hook: the benchmark history (BENCHMARKS.md at the repository's root, where each round
appends its measurements) becomes the site's page history.md. Its links into docs/ become links
between pages; its links to other files of the repository, which the site does not hold, become
the file's path as code."""

import pathlib
import re

from mkdocs.structure.files import File

ROOT = pathlib.Path(__file__).resolve().parent.parent
LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)#][^)]*)\)")


def history_markdown():
    def unlink(match):
        image, text, target = match.groups()
        if target.startswith(("http://", "https://")):
            return match.group(0)
        if target.startswith("docs/"):
            return f"{image}[{text}]({target[len('docs/'):]})"
        if image:
            return f"(plot: `{target}`)"
        return text if text.strip("`") == target else f"{text} (`{target}`)"

    return LINK.sub(unlink, (ROOT / "BENCHMARKS.md").read_text())


def on_files(files, config):
    files.append(File.generated(config, "history.md", content=history_markdown()))
    return files
