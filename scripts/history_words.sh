#!/usr/bin/env bash
# Fails when code, tests or docs name work periods instead of concepts: the *when* lives in git and
# CHANGELOG.md. Run by `make lint`.
set -euo pipefail
cd "$(dirname "$0")/.."
pattern='(this|last|previous|earlier|next|a later|first|second) session|session [0-9]+|wave [0-9]+|review round|landed store|first store|store v2|v2 store|work period'
if hits=$(git grep -n -I -i -E "$pattern" -- . ':!CHANGELOG.md' ':!benches/results' ':!scripts/history_words.sh'); then
    echo "history words outside CHANGELOG.md (name the concept, not the work period):" >&2
    echo "$hits" >&2
    exit 1
fi
echo "history words: none"
