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
echo "history words: none"
