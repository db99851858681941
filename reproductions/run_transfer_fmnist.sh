#!/usr/bin/env bash
# Evidence for Lin et al.'s Transfer and Decay (reproductions/transfer_fmnist.toml), resumable:
#   1. the greedy search on the public proxy mnist-5k (10 epochs)        -> schedule in the db
#   2. in parallel: the 5 first-epoch greedy searches that give Decay's C0 (cached in the db),
#      and any unfinished run of strategies_fmnist.toml
#   3. the grid fixed / transfer / lin-decay (greedy C0) / fixed at 0.1 and 1.0, 3 seeds
# Usage: reproductions/run_transfer_fmnist.sh [DEVICE] [WORKERS] [SECONDS]   (cuda 15 540 on a GPU)
# Every step resumes from runs/ and the db when started again; the transfer search checkpoints into
# reproductions/search_checkpoints (committed, so a later session resumes it).
set -uo pipefail
DEVICE=${1:-cpu}; WORKERS=${2:-1}; BUDGET=${3:-36000}
DB=${DPCLIP_DB:-reproductions/results.db}
DPCLIP=${DPCLIP:-dpclip}
ENGINE=${ENGINE:-ghost}
mkdir -p runs
end=$(( $(date +%s) + BUDGET ))
left() { echo $(( end - $(date +%s) )); }
SET=(--set "train.device=\"$DEVICE\"" --set "train.engine=\"$ENGINE\"")
timeout "$(left)" $DPCLIP search --dataset mnist-5k --proxy-for fashion-mnist --model papernot-cnn \
  --private-epsilon 2.7 --delta 1e-5 --match-private-epoch --batch-size 1024 --lr 1 \
  --optimizer momentum --epochs 10 --step 0.05 --engine "$ENGINE" --device "$DEVICE" \
  --name fmnist-transfer-mnist5k-d005-s0 --db "$DB" \
  --checkpoint-dir reproductions/search_checkpoints --no-progress \
  > runs/search.log 2>&1 &
search=$!
# Decay's C0: resolve the grid's lin-decay config (runs or reuses the 5 cached searches); a script
# file, not stdin, so that the parallel searches (spawned processes) can import __main__
C0_PY=$(mktemp --suffix=.py)
cat > "$C0_PY" <<'PY'
import sys
from dpclip.harness.spec import load_spec
from dpclip.store import ResultsStore
from dpclip.search import resolve_strategy_params
if __name__ == "__main__":
    db, device, engine = sys.argv[1:4]
    spec = load_spec("reproductions/transfer_fmnist.toml",
                     [f'train.device="{device}"', f'train.engine="{engine}"'])
    run = next(r for r in spec.runs() if r.config.strategy == "lin-decay")
    with ResultsStore(db) as store:
        cfg = resolve_strategy_params(run.config, store, checkpoint_root="runs/search",
                                      progress=False)
    print(cfg.strategy_params, flush=True)
PY
DPCLIP_SEARCH_WORKERS=${C0_WORKERS:-5} timeout "$(left)" ${PYTHON:-python3} "$C0_PY" "$DB" "$DEVICE" \
  "$ENGINE" > runs/c0.log 2>&1 &
c0=$!
timeout "$(left)" $DPCLIP run reproductions/strategies_fmnist.toml --db "$DB" --out runs \
  --workers 3 --set "train.device=\"$DEVICE\"" --no-progress > runs/strategies.log 2>&1
wait $c0; echo "c0 rc=$?"; wait $search; echo "search rc=$?"
timeout "$(left)" $DPCLIP run reproductions/transfer_fmnist.toml --db "$DB" --out runs \
  --workers "$WORKERS" "${SET[@]}" --no-progress > runs/transfer.log 2>&1
echo "grid rc=$?"
