"""Print which part of the code imports which: one line per (importing part, imported module).

    python scripts/import_map.py            # every cross-part import
    python scripts/import_map.py --check    # exit 1 when an import breaks the layering of docs/architecture.md

The parts are the folders of the package: ``prism_tda/`` itself (the shared ground and the CLI) and
its sub-packages ``model``, ``engine``, ``indexer``, ``service``, ``hf``. Imports inside a part are not listed.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "prism_tda"
SUBPARTS = ("model", "engine", "indexer", "service", "hf")
# who may import whom (docs/architecture.md); the ground is prism_tda minus the CLI
ALLOWED = {
    "ground": {"ground"},
    "model": {"ground", "model"},
    "engine": {"ground", "model", "engine"},
    "indexer": {"ground", "model", "engine", "indexer"},
    "service": {"ground", "model", "engine", "service"},
    "hf": {"ground", "model", "hf"},
    "cli": {"ground", "model", "engine", "indexer", "service", "hf", "cli"},
}
# the one import of a part by the ground: `import prism_tda` registers the Hugging Face classes when
# transformers is already loaded (prism_tda/__init__.py)
EXCEPTIONS = {("prism_tda/__init__.py", "prism_tda.hf")}


def part_of_file(path: Path) -> str:
    rel = path.relative_to(PACKAGE).parts
    if len(rel) > 1 and rel[0] in SUBPARTS:
        return rel[0]
    return "cli" if rel[0] in ("cli.py", "cli") else "ground"


def part_of_module(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "prism_tda":
        return None
    if len(parts) == 1:
        return "ground"
    if parts[1] in SUBPARTS:
        return parts[1]
    return "cli" if parts[1] == "cli" else "ground"


def imports(path: Path) -> list[str]:
    """Absolute module names imported by a file (relative imports resolved against its package)."""
    rel = path.relative_to(ROOT).with_suffix("")
    pkg = list(rel.parts[:-1])  # the package the file is in: prism_tda, prism_tda.engine, ...
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
                names = [f"{mod}.{a.name}" for a in node.names] if not node.module else [mod]
                out += names
            elif node.module:
                out.append(node.module)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    edges: dict[tuple[str, str], set[str]] = defaultdict(set)
    bad = []
    for f in sorted(PACKAGE.rglob("*.py")):
        src = part_of_file(f)
        for mod in imports(f):
            dst = part_of_module(mod)
            if dst is None or dst == src:
                continue
            edges[(src, dst)].add(mod.removeprefix("prism_tda."))
            if dst not in ALLOWED[src] and (str(f.relative_to(ROOT)), mod) not in EXCEPTIONS:
                bad.append(f"{f.relative_to(ROOT)} imports {mod} ({src} -> {dst})")
    for (src, dst), mods in sorted(edges.items()):
        print(f"{src:8s} -> {dst:8s} {', '.join(sorted(mods))}")
    if args.check and bad:
        print("\nlayering broken:\n  " + "\n  ".join(bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
