#!/usr/bin/env bash
# The shipped guard's recipe (`make default-guard`): calibrate on the built-in probe set with
# configs/default_guard.yaml, install its audit ledger, then evaluate it held out and live.
set -euo pipefail
bin=${1:-.venv/bin}
rm -rf abstain_guard/default_guard
"$bin/abstain-guard" calibrate --data builtin --out abstain_guard/default_guard \
    --config configs/default_guard.yaml --cache-dir runs/default_guard.cache
cp configs/default_guard/audit.jsonl abstain_guard/default_guard/ledger.jsonl
"$bin/abstain-guard" evaluate --artifact abstain_guard/default_guard --out runs/report-builtin
"$bin/abstain-guard" evaluate --artifact abstain_guard/default_guard --live --limit 300 \
    --out runs/live-builtin
"$bin/abstain-guard" evaluate --artifact abstain_guard/default_guard --live --split test \
    --config configs/default_guard_risk.yaml --out runs/live-builtin-risk
