"""Helpers shared by the benchmark scripts (import as `from _common import ...`; the
scripts run as `python benchmarks/<name>.py`, which puts this folder on sys.path)."""

from pathlib import Path


def write_docs(path, section, start, end):
    """Put `section` between the markers `start` and `end` in the Markdown file `path`
    (replacing what was there; appending the marked block if the markers are absent),
    leaving the rest of the file as it is."""
    path = Path(path)
    block = f"{start}\n{section}\n{end}"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        text = head + block + tail
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def save(report, out, docs, markdown, start, end, log=print):
    """Write the JSON `report` to `out` and the Markdown section `markdown()` between
    `start` and `end` in `docs` (each only when its path is given)."""
    import json

    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1) + "\n")
        log(f"wrote {path}")
    if docs:
        write_docs(Path(docs), markdown(), start, end)
        log(f"wrote {docs}")
