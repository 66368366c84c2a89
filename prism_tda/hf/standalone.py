"""The code an export ships for ``trust_remote_code=True``: built from our own sources, not a second copy.

``configuration_prism.py`` is ``hf/configuration.py`` as it stands (it imports only transformers).
``modeling_prism.py`` is ``model/sparse.py``, ``model/model.py`` and ``hf/modeling.py`` one after the
other, with their imports of ``prism_tda`` removed (every name they imported is then defined in the
file itself, or by :data:`SHIMS`) and the configuration imported from ``configuration_prism``. So the
exported model runs the very code ``prism_tda`` runs, in a process that imports only torch and
transformers.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]  # prism_tda/
CONFIG_FILE, MODELING_FILE = "configuration_prism.py", "modeling_prism.py"
MODELING_SOURCES = ("model/sparse.py", "model/model.py", "hf/modeling.py")
# imports of the package that become imports of the exported code
RENAMED = {"prism_tda.hf.configuration": f"from .{CONFIG_FILE[:-3]} import PrismConfig"}
# names the package imports that the standalone file defines differently
SHIMS = {
    "ModelConfig": "ModelConfig = PrismConfig  # PRISM reads ModelConfig's fields, which PrismConfig carries",
    "model_config": "def model_config(config: PrismConfig) -> PrismConfig:\n"
                    "    return config  # PRISM reads ModelConfig's fields, which PrismConfig carries",
}
HEADER = '''"""PRISM prototype language model for Hugging Face transformers (exported by prism-tda {version}).

Standalone: imports only torch and transformers. Built from prism_tda's {sources}.
"""

from __future__ import annotations

'''


def _module_name(path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    pkg = ["prism_tda", *path.relative_to(PACKAGE).parts[:-1]]
    base = pkg[: len(pkg) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _strip_package_imports(path: Path) -> tuple[str, set[str], set[str]]:
    """A source file with its docstring as a comment, without ``from __future__`` and package imports:
    (code, names those imports bound, replacement import lines)."""
    src = path.read_text()
    tree = ast.parse(src)
    lines = src.splitlines()
    drop: set[int] = set()
    names: set[str] = set()
    replaced: set[str] = set()
    body = tree.body
    doc = ast.get_docstring(tree, clean=True)
    if doc is not None:
        drop.update(range(body[0].lineno - 1, body[0].end_lineno or body[0].lineno))
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        module = _module_name(path, node)
        if module == "__future__" or module.startswith("prism_tda"):
            drop.update(range(node.lineno - 1, node.end_lineno or node.lineno))
            if module in RENAMED:
                replaced.add(RENAMED[module])
            elif module.startswith("prism_tda"):
                names.update(a.asname or a.name for a in node.names)
    code = "\n".join(line for i, line in enumerate(lines) if i not in drop).strip("\n")
    comment = "\n".join(f"# {line}".rstrip() for line in (doc or "").splitlines())
    return (comment + "\n\n" if comment else "") + code, names, replaced


def _top_level_names(code: str) -> set[str]:
    out: set[str] = set()
    for node in ast.parse(code).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out.update(t.id for t in targets if isinstance(t, ast.Name))
    return out


def modeling_source(version: str) -> str:
    """The text of ``modeling_prism.py``."""
    parts, needed, imports = [], set(), set()
    for rel in MODELING_SOURCES:
        code, names, replaced = _strip_package_imports(PACKAGE / rel)
        parts.append(f"# ---- from prism_tda/{rel} " + "-" * max(0, 70 - len(rel)) + "\n\n" + code)
        needed |= names
        imports |= replaced
    defined = _top_level_names("\n\n".join(parts))
    shims = [SHIMS[n] for n in sorted(needed - defined) if n in SHIMS]
    missing = sorted(needed - defined - set(SHIMS))
    if missing:
        raise RuntimeError(f"{MODELING_FILE}: {missing} are imported from prism_tda but not defined standalone")
    head = HEADER.format(version=version, sources=", ".join(MODELING_SOURCES))
    return "\n\n\n".join([head + "\n".join(sorted(imports)), *shims, *parts]) + "\n"


def configuration_source() -> str:
    """The text of ``configuration_prism.py``."""
    return (PACKAGE / "hf" / "configuration.py").read_text()


def write_remote_code(directory: Path, version: str) -> dict[str, str]:
    """Write both files into ``directory``; return the ``auto_map`` that names them."""
    (directory / CONFIG_FILE).write_text(configuration_source())
    (directory / MODELING_FILE).write_text(modeling_source(version))
    return {"AutoConfig": f"{CONFIG_FILE[:-3]}.PrismConfig",
            "AutoModelForCausalLM": f"{MODELING_FILE[:-3]}.PrismForCausalLM"}
