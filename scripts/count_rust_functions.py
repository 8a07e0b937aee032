import re, sys, collections
names = set()
for line in open(sys.argv[1], errors="replace"):
    if line.startswith(("fn=", "cfn=")):
        n = line.split("=", 1)[1].strip()
        n = re.sub(r"^\(\d+\)\s*", "", n)
        if n: names.add(n)
def norm(n):
    # the source function: strip closures, generic instantiations of std around kvtier types, drop glue
    if "drop_in_place" in n or n.startswith(("core::", "alloc::", "std::", "<core::", "<alloc::", "<std::")):
        return None
    n = n.split("::{{closure}}")[0]
    if not (n.startswith("kvtier_core::") or n.startswith("<kvtier_core::")):
        return None
    return n
fns = sorted({m for m in map(norm, names) if m})
for f in fns: print(f)
print(len(fns), file=sys.stderr)
