#!/usr/bin/env bash
# Fails when code, tests or docs name when something was done instead of what it is: the *when* lives in git and
# CHANGELOG.md. Run by `make lint`.
set -euo pipefail
cd "$(dirname "$0")/.."
# (each word written with a one-letter class, so this file holds none of the words it looks for)
pattern='(this|last|previous|earlier|next|a later|first|second) [s]ession|[s]ession [0-9]+|[w]ave [0-9]+|[r]eview round|[l]anded store|[f]irst store|[s]tore v2|[v]2 store|[w]ork period'
if hits=$(git grep -n -I -i -E "$pattern" -- . ':!CHANGELOG.md' ':!benches/results'); then
    echo "history words outside CHANGELOG.md (name the concept; the *when* goes to CHANGELOG.md):" >&2
    echo "$hits" >&2
    exit 1
fi
# The README and the docs also carry no commit hashes (7-40 hex digits with a letter and a digit; a store's
# namespace directory, ns-<hex>, is a name, not a hash) and no dated phrases; benches/RESULTS.md and the
# CHANGELOG keep both.
docs=(README.md 'docs/*.md')
hash='(?<!\w)(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b'
hash="(?<!ns-)$hash"
dated='[e]arlier day|[t]his day|in an? (first|second|third|fourth|earlier|later) [r]un|\b[t]oday\b|[y]esterday'
if hits=$(git grep -n -I -P "$hash" -- "${docs[@]}"); then
    echo "commit hashes in the README or docs (they belong in benches/RESULTS.md and CHANGELOG.md):" >&2
    echo "$hits" >&2
    exit 1
fi
if hits=$(git grep -n -I -i -E "$dated" -- "${docs[@]}"); then
    echo "dated phrases in the README or docs (say what is, with its figure; the *when* goes to CHANGELOG.md):" >&2
    echo "$hits" >&2
    exit 1
fi
echo "history words: none"
