"""Rebuild the bundled demo corpus from Debian's ``fortunes`` package.

The corpus is the BSD ``fortune`` cookie collection as shipped by Debian
(``fortunes`` 1:1.99.1-7.3; licence in ``prism_tda/data/LICENSE.fortunes``).
Each cookie becomes one JSONL document ``{"id", "source", "title", "text"}``.

Usage (needs ``apt-get download fortunes`` or an installed package)::

    python scripts/make_demo_corpus.py /usr/share/games/fortunes prism_tda/data/fortunes.jsonl.gz
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

# Pictures and a file of jokes about ethnic groups are left out of the demo corpus.
EXCLUDED = {"ascii-art", "ethnic"}


def main(src: str, dst: str) -> None:
    root = Path(src)
    n = 0
    with gzip.open(dst, "wt", encoding="utf-8", compresslevel=9) as out:
        for path in sorted(root.iterdir()):
            if path.suffix in {".dat", ".u8"} or path.name in EXCLUDED or path.is_symlink():
                continue
            raw = path.read_bytes().decode("utf-8", errors="replace")
            for i, chunk in enumerate(raw.split("\n%\n")):
                text = chunk.strip("\n%").rstrip()
                if not text.strip():
                    continue
                rec = {"id": f"{path.name}/{i:05d}", "source": "fortunes", "title": path.name, "text": text}
                out.write(json.dumps(rec, ensure_ascii=False) + "\n")
                n += 1
    print(f"wrote {n} documents to {dst}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
