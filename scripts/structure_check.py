#!/usr/bin/env python3
"""The house's structure rules, checked (part of `make lint`).

1. No import circle among kvtier's Python modules: every `import`, at module level or inside a function, is an
   edge (a lazy import that hides a circle is still a circle).
2. No import circle among kvtier-core's Rust modules, at two levels: among the modules of the crate (a top-level
   directory or file under `src/`), and among the modules inside each of those directories (`store/journal.rs`
   and everything under `store/journal/` count as the module `store::journal`). A path in module b that names
   module a (`crate::a`, `super::a`, `super::super::a`, `crate::store::a`, or inside a `{...}` group after one
   of those) is an edge from b to a. Tests (`tests/` directories, files named `*test*`) and inline
   `#[cfg(test)] mod tests` blocks are excluded; so are comments.
3. No library module reaches another object's private names: an attribute `x._name` (or `getattr(x, "_name")`)
   is allowed only on `self` or `cls`. Dunder names (`__x__`) are public protocol; the few private names of
   torch, transformers and Triton objects kvtier must read are listed in THIRD_PARTY_PRIVATE with the reason.
4. No library source file over 500 lines (Python under python/kvtier, Rust under rust/*/src, tests aside).
5. No library module imports another module's private names: `from kvtier.x import _name` (relative or
   absolute, renamed or not) is a reach-in too; a private *module* (`from . import _store_cli`) is its package's.

Exit status 1 with one line per finding; 0 and a one-line summary otherwise.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY_ROOT = ROOT / "python"
PACKAGE = "kvtier"
RUST_CORE = ROOT / "rust" / "kvtier-core" / "src"
MAX_LINES = 500
COMPILED = {"kvtier._native"}  # private modules that are not Python files (the binding)
# Private names of other projects' objects that have no public equivalent, each with the reason it is read.
THIRD_PARTY_PRIVATE = {
    "_version": "torch.Tensor's in-place version counter: the only way to see that an index tensor was changed",
    "_C": "torch's C extension: the raw current-stream handle and the pinned allocator's cache flush",
    "_cuda_getCurrentRawStream": "torch._C: the current stream's handle without building a Stream object",
    "_host_emptyCache": "torch._C: empties the pinned-memory allocator's cache (the pinning bench's baseline)",
    "_attn_implementation": "transformers' config: which attention a model runs (no public getter in 5.x)",
    "_commit_hash": "transformers' config: the checkpoint revision, part of the cache's model identity",
    "_init_handles": "Triton's compiled kernel: loads the module so its CUfunction can be launched natively",
}


def python_modules() -> dict[str, Path]:
    out = {}
    for path in sorted((PY_ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(PY_ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    if level == 0:
        return name or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def python_edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, is_package, node.level, node.module)
                targets = [base]
                targets += [f"{base}.{a.name}" for a in node.names]
            for target in targets:
                # The longest known module the name falls in (a package's submodule, or the module itself).
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != module and not module.startswith(target + "."):
                    edges[module].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


RUST_PATH = re.compile(r"\b(crate|self|super)\b((?:::super\b)*)((?:::(?!super\b)\w+)*)(::\{)?")
RUST_COMMENT = re.compile(r"//[^\n]*")


def _group_heads(text: str, start: int) -> list[str]:
    """The first name of each item of the `{...}` group opening at `text[start]` (nested groups skipped)."""
    heads, depth, item = [], 0, ""
    for ch in text[start:]:
        if ch == "{":
            depth += 1
            if depth == 1:
                continue
        elif ch == "}":
            depth -= 1
            if depth == 0:
                break
        if depth == 1 and ch == ",":
            heads.append(item)
            item = ""
        elif depth >= 1:
            item += ch
    heads.append(item)
    return [h.strip().split("::")[0].strip() for h in heads if h.strip()]


def _module_path(rel: Path) -> list[str]:
    """`store/journal/layout.rs` -> ["store", "journal", "layout"]; a `mod.rs` is its directory's module."""
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "mod":
        parts = parts[:-1]
    return parts


def _rust_paths(text: str, module: list[str]) -> set[tuple[str, ...]]:
    """Every path named in `text` (of the file of `module`) that starts at `crate`, `self` or a `super` chain,
    resolved from the crate root as a tuple of names (a `{...}` group gives one path per item)."""
    out = set()
    for m in RUST_PATH.finditer(text):
        root, supers, chain, group = m.groups()
        if root == "crate":
            base = []
        else:
            up = (1 if root == "super" else 0) + supers.count("super")
            if up > len(module):
                continue
            base = module[: len(module) - up]
        names = [n for n in chain.split("::") if n]
        heads = _group_heads(text, m.end() - 1) if group else [""]
        for h in heads:
            path = base + names + ([h] if h else [])
            if path and all(n.isidentifier() for n in path):
                out.add(tuple(path))
    return out


def _children(directory: Path) -> set[str]:
    return {p.stem if p.is_file() else p.name for p in directory.iterdir()
            if p.name not in ("lib.rs", "mod.rs") and (p.suffix == ".rs" or p.is_dir())
            and p.name != "tests" and "test" not in p.stem}


def rust_edges() -> dict[str, dict[str, set[str]]]:
    """Module edges per level: "" the crate's modules, "store" the modules inside `src/store/`, and so on for
    each top-level directory."""
    levels: dict[str, dict[str, set[str]]] = {"": {m: set() for m in _children(RUST_CORE)}}
    for d in sorted(p for p in RUST_CORE.iterdir() if p.is_dir()):
        levels[d.name] = {m: set() for m in _children(d)}
    for path in sorted(RUST_CORE.rglob("*.rs")):
        rel = path.relative_to(RUST_CORE)
        if rel.name == "lib.rs" or "test" in rel.stem or "tests" in rel.parts:
            continue
        module = _module_path(rel)
        text = path.read_text().split("#[cfg(test)]\nmod tests {")[0]
        text = RUST_COMMENT.sub("", text)
        for target in _rust_paths(text, module):
            # the crate level: a module naming another top-level module
            if target[0] in levels[""] and target[0] != module[0]:
                levels[""][module[0]].add(target[0])
            # one level down: a module of a directory naming another module of that directory
            if (len(module) >= 2 and len(target) >= 2 and target[0] == module[0] and module[0] in levels
                    and target[1] in levels[module[0]] and target[1] != module[1]):
                levels[module[0]][module[1]].add(target[1])
    return levels


def private_reach_ins(modules: dict[str, Path]) -> list[str]:
    out = []
    for path in modules.values():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
                name, target = node.args[1].value, node.args[0]
                private = name.startswith("_") and not (name.startswith("__") and name.endswith("__"))
                if private and name not in THIRD_PARTY_PRIVATE and not (
                        isinstance(target, ast.Name) and target.id in ("self", "cls")):
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno}: reaches {ast.unparse(target)}.{name} "
                               f"by {node.func.id}")
                continue
            if not isinstance(node, ast.Attribute):
                continue
            name = node.attr
            if not name.startswith("_") or (name.startswith("__") and name.endswith("__")):
                continue
            if name in THIRD_PARTY_PRIVATE:
                continue
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}: reaches {ast.unparse(base)}.{name}")
    return out


def private_imports(modules: dict[str, Path]) -> list[str]:
    out = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = _resolve(module, path.name == "__init__.py", node.level, node.module)
            if base not in modules:
                continue  # another project's module
            for a in node.names:
                private = a.name.startswith("_") and not (a.name.startswith("__") and a.name.endswith("__"))
                if private and f"{base}.{a.name}" not in modules and f"{base}.{a.name}" not in COMPILED:
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno}: imports {base}.{a.name}, a private name "
                               "of another module")
    return out


def long_files() -> list[str]:
    out = []
    paths = list((PY_ROOT / PACKAGE).rglob("*.py"))
    for crate in (ROOT / "rust").iterdir():
        paths += [p for p in (crate / "src").rglob("*.rs")
                  if "test" not in p.stem and "tests" not in p.relative_to(crate / "src").parts]
    for path in sorted(paths):
        n = len(path.read_text().splitlines())
        if n > MAX_LINES:
            out.append(f"{path.relative_to(ROOT)}: {n} lines (at most {MAX_LINES})")
    return out


def main() -> int:
    modules = python_modules()
    findings = []
    for c in cycles(python_edges(modules)):
        findings.append("python import circle: " + " <-> ".join(c))
    for level, edges in rust_edges().items():
        for c in cycles(edges):
            where = f" in {level}" if level else ""
            findings.append(f"kvtier-core module circle{where}: " + " <-> ".join(c))
    findings += private_reach_ins(modules)
    findings += private_imports(modules)
    findings += long_files()
    for f in findings:
        print(f)
    if findings:
        print(f"structure check: {len(findings)} findings", file=sys.stderr)
        return 1
    print(f"structure check: {len(modules)} Python modules, no circle, no private reach-in or import, no file over {MAX_LINES} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
