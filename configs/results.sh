#!/usr/bin/env bash
# docs/results (`make results`): one artifact a public data set, the baselines beside each.
# Usage: configs/results.sh BIN DATA LIMIT
set -euo pipefail
bin=${1:-.venv/bin} data=${2:-../shared/data} limit=${3:-500}
sets=(triviaqa=$data/triviaqa_subset truthfulqa=$data/truthfulqa sciq=$data/sciq
    commonsenseqa=$data/commonsenseqa nq_open=$data/nq_open)
artifacts=()
for spec in "${sets[@]}"; do
    "$bin/abstain-guard" calibrate --data "$spec" --out "runs/${spec%%=*}" --limit "$limit" --quiet
    artifacts+=(--artifact "runs/${spec%%=*}")
done
"$bin/abstain-guard" evaluate --out runs/report-builtin --artifact abstain_guard/default_guard \
    --baselines perplexity,max_sequence_probability,mean_token_entropy,p_true,attention_score
"$bin/abstain-guard" evaluate --out runs/report-datasets --baselines likelihood "${artifacts[@]}"
"$bin/abstain-guard" report --out docs/results \
    --results runs/report-builtin/results.json runs/report-datasets/results.json
