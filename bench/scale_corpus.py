"""A real text corpus of tens of millions of tokens, assembled from Debian's documentation packages,
the bundled fortunes and planted facts, for ``bench/scale.py``.

    apt-get install python3.11-doc perl-doc postgresql-doc-15 git-doc manpages manpages-dev \\
        glibc-doc debian-reference-en gnu-standards bash-doc
    python -m bench.scale_corpus --out runs/scale/corpus

Sources, in this order (each file cut into documents of about 2,000 characters at paragraph breaks):
the Python 3.11 documentation's reStructuredText sources, Perl's POD, PostgreSQL's and Git's HTML
and text documentation (tags stripped), the manual pages (roff requests stripped), the GNU info
manuals and the fortunes, shuffled (seeded) so that every prefix mixes every source, and 30
planted facts (20 copies each) spread through it. Files are written as JSONL of about 16 MB each,
with ``manifest.json`` (documents and characters per source, each file's SHA-256: the manual pages
come from every installed package, so two machines build different corpora, and ``bench/scale.py``
copies the manifest into its results to say which one it read);
``bench/scale.py`` indexes a prefix of them and takes its queries from the last.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import html
import json
import random
import re
from collections.abc import Iterator
from pathlib import Path

from bench.attribution.planted import make_facts
from prism_tda import demo_corpus_path

SOURCES = [
    ("python-doc", "/usr/share/doc/python3.11/html/_sources", "*.txt"),
    ("perl-pod", "/usr/share/perl/5.36.0", "*.pod"),
    ("perl-pod", "/usr/share/perl/5.36/pod", "*.pod"),
    ("postgresql-doc", "/usr/share/doc/postgresql-doc-15/html", "*.html"),
    ("git-doc", "/usr/share/doc/git-doc", "*.txt"),
    ("git-doc", "/usr/share/doc/git-doc", "*.html"),
    ("man", "/usr/share/man/man1", "*.gz"), ("man", "/usr/share/man/man2", "*.gz"),
    ("man", "/usr/share/man/man3", "*.gz"), ("man", "/usr/share/man/man5", "*.gz"),
    ("man", "/usr/share/man/man7", "*.gz"), ("man", "/usr/share/man/man8", "*.gz"),
    ("info", "/usr/share/info", "*.gz"),
    ("debian-reference", "/usr/share/doc/debian-reference-en", "*.html"),
]
DOC_CHARS = 2000
FILE_BYTES = 16 << 20
TAG = re.compile(r"<[^>]+>")
ROFF_REQUEST = re.compile(r"^\.[A-Za-z\\].*$|^'.*$", re.M)
ROFF_ESCAPE = re.compile(r"\\f[BIRP]|\\f\(..|\\\(..|\\[&e%-]|\\s[+-]?\d")


def _text(path: Path) -> str:
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    text = raw.decode("utf-8", errors="replace")
    if path.suffix == ".html":
        text = re.sub(r"(?is)<(script|style).*?</\1>", " ", text)
        text = html.unescape(TAG.sub(" ", text))
    elif "/man/" in str(path):
        text = ROFF_ESCAPE.sub("", ROFF_REQUEST.sub("", text))
    return re.sub(r"[ \t]+", " ", text).strip()


def _chunks(text: str) -> Iterator[str]:
    buf = ""
    for para in re.split(r"\n\s*\n", text):
        para = para.strip()
        if not para:
            continue
        if buf and len(buf) + len(para) > DOC_CHARS:
            yield buf
            buf = ""
        buf = f"{buf}\n\n{para}" if buf else para
        while len(buf) > 2 * DOC_CHARS:  # a very long paragraph: cut it
            yield buf[:DOC_CHARS]
            buf = buf[DOC_CHARS:]
    if buf:
        yield buf


def documents() -> Iterator[dict]:
    seen = set()
    for source, folder, pattern in SOURCES:
        for f in sorted(Path(folder).rglob(pattern)) if Path(folder).is_dir() else []:
            if f in seen:
                continue
            seen.add(f)
            try:
                text = _text(f)
            except OSError:
                continue
            for j, chunk in enumerate(_chunks(text)):
                if len(chunk) > 200:
                    yield {"id": f"{source}/{f.relative_to(folder)}#{j}", "source": source, "text": chunk}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/scale/corpus")
    ap.add_argument("--facts", type=int, default=30)
    ap.add_argument("--copies", type=int, default=20)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    docs = list(documents())
    with gzip.open(demo_corpus_path(), "rt") as fh:
        docs += [json.loads(line) for line in fh]
    rng = random.Random(0)
    rng.shuffle(docs)  # every prefix of the files is a mix of every source
    facts = make_facts(args.facts, args.copies, seed=0)
    for f in facts:  # each copy somewhere in the corpus
        for d in f.doc_ids:
            docs.insert(rng.randrange(len(docs) + 1), {"id": d, "source": "planted", "title": f.fact_id,
                                                       "text": f.text})
    (out / "facts.json").write_text(json.dumps([f.__dict__ for f in facts], indent=2))
    n_file, size, fh = 0, 0, None
    for d in docs:
        if fh is None or size >= FILE_BYTES:
            if fh is not None:
                fh.close()
            fh = open(out / f"part-{n_file:03d}.jsonl", "w")
            n_file, size = n_file + 1, 0
        line = json.dumps(d) + "\n"
        fh.write(line)
        size += len(line.encode())
    if fh is not None:
        fh.close()
    total = sum(p.stat().st_size for p in out.glob("part-*.jsonl"))
    info = {"documents": len(docs), "files": n_file, "bytes": total}
    (out / MANIFEST).write_text(json.dumps(info | corpus_manifest(docs, out), indent=2))
    print(json.dumps(info))


MANIFEST = "manifest.json"


def corpus_manifest(docs: list[dict], out: Path) -> dict:
    """What this build of the corpus holds, so two runs can tell whether they read the same text: the
    documents and characters of each source (the manual pages come from every installed package, so
    they differ between machines) and each file's SHA-256."""
    per: dict[str, dict[str, int]] = {}
    for d in docs:
        s = per.setdefault(d.get("source", "fortunes"), {"documents": 0, "characters": 0})
        s["documents"] += 1
        s["characters"] += len(d["text"])
    return {"sources": dict(sorted(per.items())),
            "sha256": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.glob("part-*.jsonl"))}}


if __name__ == "__main__":
    main()
