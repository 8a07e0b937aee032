#!/usr/bin/env python3
"""The house's structure rules, checked (part of `make lint`).

1. No import circle among kvtier's Python modules: every `import`, at module level or inside a function, is an
   edge (a lazy import that hides a circle is still a circle).
2. No import circle among kvtier-core's Rust modules, at two levels: among the modules of the crate (a top-level
   directory or file under `src/`), and among the modules inside each of those directories (`store/journal.rs`
   and everything under `store/journal/` count as the module `store::journal`). A path in module b that names
   an item of module a is an edge from b to a. Paths are read from the code with comments and string literals
   removed (a `"//"` hides nothing), from `crate`, `self`, a `super` chain, a child module or a name a `use`
   binds, and resolved to where the item comes from: through nested `{...}` groups, `use ... as alias`, a glob
   (`use super::*` brings the parent's child modules and imports), and re-exports (`crate::store::VerifyReport`
   is a path into `store::io` when store/mod.rs has `pub use io::read::VerifyReport`; a private `use` too, as
   child modules may name it). Test modules are left out: a module named exactly `tests` or `tests_<topic>`
   that its parent declares under `#[cfg(test)]`, everything under it, and inline `#[cfg(test)] mod x {...}`
   blocks. Out of scope: calls that name no path, such as a method of a type (`impl Shared` in one module
   called from another through `self.x()`), macros that build paths, and `#[path]` attributes.
3. No library module reaches another object's private names: an attribute `x._name` (or `getattr(x, "_name")`)
   is allowed only on `self` or `cls`. Dunder names (`__x__`) are public protocol; the few private names of
   torch, transformers and Triton objects kvtier must read are listed in THIRD_PARTY_PRIVATE with the reason.
4. No library source file over 500 lines (Python under python/kvtier, Rust under rust/*/src, test modules as
   in 2 aside).
5. No library module imports another module's private names: `from kvtier.x import _name` (relative or
   absolute, renamed or not) is a reach-in too; a private *module* (`from . import _store_cli`) is its package's.
6. No mixin: no class in python/kvtier reads a `self.x` that neither it nor a base class of the package sets (a
   method, property or valued class attribute of its body, a dataclass field, or `self.x = ...` / `setattr(self,
   "x", ...)` in any method). Such a class runs on its subclass's state: make it a component its host owns and
   hands exactly what it needs. A bare annotation (`store: Any`) declares, it sets nothing. Not judged: a class
   with a base from outside the package (whose attributes this check cannot see), a Protocol (an interface
   declares), one with `__getattr__`. Mixins not converted yet are in MIXINS_ALLOWED, each with its issue.

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

# Mixins (rule 6) not yet made components, each with the issue that converts it: reported by name, never silently.
MIXINS_ALLOWED: dict[str, str] = {}
ATTRIBUTELESS_BASES = {"object", "Generic", "ABC"}  # bases that give a class no attributes


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


def strip_rust(text: str) -> str:
    """`text` without its comments (`//`, nested `/* */`) and with every string and char literal emptied, so
    neither a `//` inside a string nor a path inside a comment or a string is taken for code."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
        elif c == "r" and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")) and re.match(
                r'r#*"', text[i:i + 64]):
            hashes = len(re.match(r"r(#*)", text[i:]).group(1))
            end = text.find('"' + "#" * hashes, i + 2 + hashes)
            out.append('""')
            i = n if end < 0 else end + 1 + hashes
        elif c == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            out.append('""')
            i += 1
        elif c == "'":
            if text.startswith("\\", i + 1):  # an escaped char literal: '\n', '\'', '\u{..}'
                end = text.find("'", i + 3)
                out.append("' '")
                i = n if end < 0 else end + 1
            elif i + 2 < n and text[i + 2] == "'":  # a char literal: '{', '"'
                out.append("' '")
                i += 3
            else:  # a lifetime
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _drop_test_blocks(code: str) -> str:
    """`code` without its inline `#[cfg(test)] mod name { ... }` blocks (comments and strings already gone)."""
    while m := re.search(r"#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+\w+\s*\{", code):
        depth, i = 0, m.end() - 1
        for i in range(m.end() - 1, len(code)):
            depth += {"{": 1, "}": -1}.get(code[i], 0)
            if depth == 0:
                break
        code = code[:m.start()] + code[i + 1:]
    return code


def _use_trees(code: str) -> list[tuple[list[str], str | None]]:
    """Every `use` item of `code` as (the path as written, the name it binds): `use a::{b::{c as d}, e::*}`
    gives (["a", "b", "c"], "d") and (["a", "e"], "*"); `use a::{self}` gives (["a"], "a")."""
    found = []
    for m in re.finditer(r"\buse\s+([^;]*);", code):
        tokens = re.findall(r"::|[{},*]|\w+", m.group(1))
        pos = [0]

        def peek() -> str | None:
            return tokens[pos[0]] if pos[0] < len(tokens) else None

        def take() -> str | None:
            tok = peek()
            pos[0] += 1
            return tok

        def tree(prefix: list[str]) -> None:
            segs = []
            if peek() == "::":
                take()
            while (tok := peek()) and re.fullmatch(r"\w+", tok) and tok != "as":
                segs.append(take())
                if peek() == "::":
                    take()
                else:
                    break
            path = prefix + segs
            tok = peek()
            if tok == "{":
                take()
                while peek() not in (None, "}"):
                    tree(path)
                    if peek() == ",":
                        take()
                take()
            elif tok == "*":
                take()
                found.append((path, "*"))
            elif tok == "as":
                take()
                found.append((path, take()))
            elif path:
                if path[-1] == "self":
                    path = path[:-1]
                if path:
                    found.append((path, path[-1]))

        while peek() is not None:
            before = pos[0]
            tree([])
            if peek() == ",":
                take()
            if pos[0] == before:
                take()
    return found


def _module_path(rel: Path) -> list[str]:
    """`store/journal/layout.rs` -> ["store", "journal", "layout"]; a `mod.rs` is its directory's module."""
    parts = list(rel.with_suffix("").parts)
    if parts[-1] in ("mod", "lib", "main") and (parts[-1] == "mod" or len(parts) == 1):
        parts = parts[:-1]
    return parts


def _module_file(src: Path, module: tuple[str, ...]) -> Path | None:
    if not module:
        return src / "lib.rs" if (src / "lib.rs").exists() else src / "main.rs"
    for p in (src.joinpath(*module).with_suffix(".rs"), src.joinpath(*module, "mod.rs")):
        if p.exists():
            return p
    return None


def _is_test_module(src: Path, module: tuple[str, ...]) -> bool:
    """Whether `module` is a test module or inside one: a module named exactly `tests` or `tests_<topic>`
    (the file's stem, not a substring of it) that its parent declares under `#[cfg(test)]`."""
    for i, name in enumerate(module):
        if name != "tests" and not name.startswith("tests_"):
            continue
        parent = _module_file(src, module[:i])
        if parent is None:
            continue
        decl = re.compile(r"(?:(?:#\[[^\]]*\]|pub(?:\([^)]*\))?)\s*)*mod\s+" + re.escape(name) + r"\s*;")
        for m in decl.finditer(strip_rust(parent.read_text())):
            if "#[cfg(test)]" in m.group(0):
                return True
    return False


class RustCrate:
    """A crate's module tree and what each module's `use` items bind, to resolve a path to the module its item
    comes from: through `use ... as alias`, a glob (`use super::*` brings the parent's child modules and
    imports), and a re-export (`pub use io::read::VerifyReport` in store/mod.rs makes `crate::store::
    VerifyReport` a path into `store::io`; a private `use` counts too, as child modules may name it)."""

    def __init__(self, src: Path):
        self.src = src
        self.files: dict[tuple[str, ...], Path] = {}
        self.tests: set[tuple[str, ...]] = set()
        for path in sorted(src.rglob("*.rs")):
            module = tuple(_module_path(path.relative_to(src)))
            if _is_test_module(src, module):
                self.tests.add(module)
            else:
                self.files[module] = path
        self.code = {m: _drop_test_blocks(strip_rust(p.read_text())) for m, p in self.files.items()}
        self._scopes: dict[tuple[str, ...], tuple[dict, list]] = {}

    def children(self, module: tuple[str, ...]) -> set[str]:
        return {m[-1] for m in self.files if len(m) == len(module) + 1 and m[:-1] == module}

    def _start(self, module: tuple[str, ...], segs: list[str], names: dict | None) -> list[str] | None:
        """`segs` as written in `module` made absolute (None: another crate's, or unknown)."""
        up = 0
        while up < len(segs) and segs[up] == "super":
            up += 1
        if up:
            return list(module[: len(module) - up]) + segs[up:] if up <= len(module) else None
        head, rest = segs[0], segs[1:]
        if head == "crate":
            return rest
        if head == "self":
            return list(module) + rest
        if head in self.children(module):
            return list(module) + segs
        if names is None:
            names, globs = self.scope(module)
        else:
            globs = []
        if head in names:
            bound = names[head]
            return None if bound is None else bound + rest
        for g in globs:
            if head in self.children(tuple(g)) or head in self.scope(tuple(g))[0]:
                return g + segs
        return None

    def scope(self, module: tuple[str, ...]) -> tuple[dict[str, list[str] | None], list[list[str]]]:
        """The names `module`'s `use` items bind (None: another crate's) and the modules it glob-imports."""
        if module in self._scopes:
            return self._scopes[module]
        names: dict[str, list[str] | None] = {}
        globs: list[list[str]] = []
        self._scopes[module] = (names, globs)
        trees = _use_trees(self.code.get(module, ""))
        pending = []
        for segs, bind in trees:
            if not segs:
                continue
            head = segs[0]
            if head in ("crate", "self", "super") or head in self.children(module):
                target = self._start(module, segs, {})
                if bind == "*":
                    if target is not None:
                        globs.append(target)
                elif bind != "_":
                    names[bind] = target
            else:
                pending.append((segs, bind))
        for segs, bind in pending:  # a path through another import of the module (`use io::x; use x::y;`)
            target = self._start(module, segs, names) if segs[0] in names else None
            if bind == "*":
                if target is not None:
                    globs.append(target)
            elif bind != "_":
                names.setdefault(bind, target)
        return names, globs

    def canonical(self, path: list[str], depth: int = 0) -> list[str]:
        """`path` (absolute) with each name bound by a module's `use` replaced by what it binds."""
        if depth > 32:
            return path
        for i in range(len(path)):
            prefix = tuple(path[:i])
            if prefix not in self.files:
                return path
            name = path[i]
            if name in self.children(prefix):
                continue
            names, globs = self.scope(prefix)
            if name in names:
                bound = names[name]
                return path if bound is None else self.canonical(bound + path[i + 1:], depth + 1)
            for g in globs:
                if tuple(g) != prefix and (name in self.children(tuple(g)) or name in self.scope(tuple(g))[0]):
                    return self.canonical(g + path[i:], depth + 1)
            return path
        return path

    def targets(self, module: tuple[str, ...]) -> set[tuple[str, ...]]:
        """Every path `module`'s code names, resolved to where its item comes from."""
        code = self.code[module]
        out = set()
        written = [segs for segs, bind in _use_trees(code)]
        written += [m.group(1).split("::") for m in
                    re.finditer(r"(?<![\w:])([A-Za-z_]\w*(?:::[A-Za-z_]\w*)+)", code)]
        for segs in written:
            start = self._start(module, segs, None)
            if start:
                out.add(tuple(self.canonical(start)))
        return out


def rust_edges() -> dict[str, dict[str, set[str]]]:
    """Module edges per level: "" the crate's modules, "store" the modules inside `src/store/`, and so on for
    each top-level directory."""
    crate = RustCrate(RUST_CORE)
    levels: dict[str, dict[str, set[str]]] = {"": {m[0]: set() for m in crate.files if len(m) == 1}}
    for top in sorted(m[0] for m in crate.files if len(m) == 1 and (RUST_CORE / m[0]).is_dir()):
        levels[top] = {m[1]: set() for m in crate.files if len(m) == 2 and m[0] == top}
    for module in sorted(m for m in crate.files if m):
        for target in crate.targets(module):
            if not target:
                continue
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


def _base_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Subscript):  # Generic[T]
        node = node.value
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _class_body(stmts: list[ast.stmt]) -> list[ast.stmt]:
    """A class body's statements, through `if`/`else` and `try` blocks (not into functions or classes)."""
    out: list[ast.stmt] = []
    for st in stmts:
        out.append(st)
        if isinstance(st, ast.If):
            out += _class_body(st.body) + _class_body(st.orelse)
        elif isinstance(st, ast.Try):
            out += _class_body(st.body + st.orelse + st.finalbody + [x for h in st.handlers for x in h.body])
    return out


def _sets(cls: ast.ClassDef) -> set[str]:
    """The attributes a class sets itself (see rule 6)."""
    out: set[str] = set()
    dataclass = any((_base_name(d.func if isinstance(d, ast.Call) else d) or "").endswith("dataclass")
                    for d in cls.decorator_list)
    for st in _class_body(cls.body):
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(st.name)
        elif isinstance(st, ast.Assign):
            out |= {n.id for t in st.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and (st.value is not None or dataclass):
            out.add(st.target.id)
    for node in ast.walk(cls):
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del))
                and isinstance(node.value, ast.Name) and node.value.id == "self"):
            out.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
              and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) and node.args[0].id == "self"
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            out.add(node.args[1].value)
    return out


def mixins(modules: dict[str, Path]) -> list[tuple[str, Path, int, list[str]]]:
    """Every class of the package that reads `self.x` attributes neither it nor its package bases set (rule 6):
    (module.Class, its file, its line, the attributes)."""
    classes: dict[tuple[str, str], ast.ClassDef] = {}
    scope: dict[str, dict[str, tuple[str, str]]] = {}  # per module: a name -> the (module, class) it is
    trees = {m: ast.parse(p.read_text(), str(p)) for m, p in modules.items()}
    for module, tree in trees.items():
        scope[module] = {}
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                classes[(module, node.name)] = node
                scope[module][node.name] = (module, node.name)
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = _resolve(module, modules[module].name == "__init__.py", node.level, node.module)
                for a in node.names:
                    scope[module].setdefault(a.asname or a.name, (base, a.name))

    def bases(key: tuple[str, str]) -> list[tuple[str, str]] | None:
        """The package classes `key`'s bases are; None: one is from outside the package, or it is a Protocol."""
        out = []
        for b in classes[key].bases:
            name = _base_name(b)
            if name in ATTRIBUTELESS_BASES:
                continue
            found = scope[key[0]].get(name or "")
            if name == "Protocol" or found not in classes:
                return None
            out.append(found)
        return out

    def sets(key: tuple[str, str], seen: set[tuple[str, str]]) -> set[str]:
        got = _sets(classes[key])
        for b in bases(key) or []:
            if b not in seen:
                seen.add(b)
                got |= sets(b, seen)
        return got

    found = []
    for key, cls in sorted(classes.items()):
        if bases(key) is None or "__getattr__" in _sets(cls):
            continue
        have = sets(key, {key})
        reads = sorted({n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load)
                        and isinstance(n.value, ast.Name) and n.value.id == "self" and n.attr not in have
                        and not (n.attr.startswith("__") and n.attr.endswith("__"))})
        if reads:
            found.append((".".join(key), modules[key[0]], cls.lineno, reads))
    return found


def mixin_findings(modules: dict[str, Path]) -> tuple[list[str], list[str]]:
    """Rule 6's findings, and the allowed mixins it found (to report); an allowed one no longer found is a
    finding too (the allowlist only shrinks)."""
    out, allowed = [], []
    seen = set()
    for name, path, line, reads in mixins(modules):
        seen.add(name)
        if name in MIXINS_ALLOWED:
            allowed.append(f"{name} ({MIXINS_ALLOWED[name]})")
            continue
        out.append(f"{path.relative_to(ROOT)}:{line}: {name} reads self.{', self.'.join(reads)}, which neither it "
                   "nor a base of the package sets (a mixin: make it a component its host owns)")
    out += [f"MIXINS_ALLOWED: {name} is no mixin any more; take it off the list" for name in MIXINS_ALLOWED
            if name not in seen]
    return out, allowed


def long_files() -> list[str]:
    out = []
    paths = list((PY_ROOT / PACKAGE).rglob("*.py"))
    for crate in (ROOT / "rust").iterdir():
        src = crate / "src"
        paths += [p for p in src.rglob("*.rs")
                  if not _is_test_module(src, tuple(_module_path(p.relative_to(src))))]
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
    mixin_out, allowed = mixin_findings(modules)
    findings += mixin_out
    for f in findings:
        print(f)
    if findings:
        print(f"structure check: {len(findings)} findings", file=sys.stderr)
        return 1
    print(f"structure check: {len(modules)} Python modules, no circle, no private reach-in or import, no file over "
          f"{MAX_LINES} lines, no mixin but {len(allowed)} allowed: {'; '.join(allowed) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
