#!/usr/bin/env bash
# One call on a lent GPU machine (16 cores, one H100): the Lin Table 2 (TAN) levels and the Xia
# Table 2 (TAN) spec as reproductions/shard.py cells under CUDA MPS until a deadline, then every
# cell's database and checkpoints packed into $OUT (15 MB pieces) to be merged and resumed on the
# CPU (docs/tuning.md, "On a GPU machine"). Run from the repository root; the machine needs torch,
# the wheels of dp-accounting, dm-tree, mlxtend and kymatio (+ appdirs, configparser: the
# ScatterNet+AugMult8 row of fmnist_best_eps27.toml) in .whl/ and Fashion-MNIST under .gpu/data.
#   END_DL: seconds after the start at which the cells are stopped (default 505)
#   EPS: the Lin levels to run (default "1.5 4.5"); DEV: cuda (cpu for a dry run)
#   JOB: "lin" (default: the Lin / Xia TAN cells above) or "issue36": the rows issue 36 still
#        needs, as shard.py cells: the Auto-V column of xia_table2_tan.toml (--only Auto-V), the
#        re-run Lin columns of lin_table2_rerun.toml (AdaClip with batch noise, Andrew with an lr
#        space for its moving threshold) and fmnist_best_eps27.toml (the multiplicity rows); or
#        "autov", "rerun", "best": one of these three alone
# This is what produced the eps 1.5 / 4.5 rows of lin-table2-fmnist-tan and xia-table2-fmnist-tan,
# except --workers: the call that ran used 3 final-run workers in every cell, which put ~80
# processes on the GPU; MPS serves at most 48 clients, and the runs that started beyond that
# failed with "CUDA-capable device(s) is/are busy or unavailable". One worker per Lin cell keeps
# the count under 48 (16 cells + 3 Xia cells x 4 + the two Decay cells' 5 search workers each).
set -u
T0=$(date +%s)
left() { echo $(( T0 + $1 - $(date +%s) )); }
OUT=${OUT:?set OUT to the folder that comes back}
[ -n "${SKIP_PIP:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile \
  --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=$PWD/src:/tmp/site DPCLIP_DATA=$PWD/.gpu/data OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
MPS=0
if command -v nvidia-cuda-mps-control >/dev/null; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  if nvidia-cuda-mps-control -d && timeout 60 python3 -c \
      "import torch; print('mps probe', torch.ones(8, device='cuda').sum().item())"; then
    MPS=1
  else
    echo quit | nvidia-cuda-mps-control; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  fi
fi
echo "MPS=$MPS"
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader -l 15 > $OUT/smi.log 2>&1 &
SMI=$!
W=/tmp/gw; mkdir -p $W
DEV=${DEV:-cuda}
DL=$(left ${END_DL:-505}); TO=$(left $(( ${END_DL:-505} + 55 )))
COMMON=(--threads 1 --set "train.device=\"$DEV\"" --deadline-s $DL)
pids=()
JOB=${JOB:-lin}
case $JOB in issue36|autov|rerun|best) ;; lin) ;; *) echo "unknown JOB=$JOB"; exit 2 ;; esac
if [ $JOB = issue36 ] || [ $JOB = autov ]; then
  timeout $TO python3 reproductions/shard.py reproductions/xia_table2_tan.toml --only Auto-V \
    --db $W/autov.db --work $W/w_autov --jobs 1 --workers 3 "${COMMON[@]}" > $W/autov.log 2>&1 &
  pids+=($!)
fi
if [ $JOB = issue36 ] || [ $JOB = rerun ]; then
  timeout $TO python3 reproductions/shard.py reproductions/lin_table2_rerun.toml \
    --db $W/rerun.db --work $W/w_rerun --jobs 6 --workers 1 "${COMMON[@]}" > $W/rerun.log 2>&1 &
  pids+=($!)
fi
if [ $JOB = issue36 ] || [ $JOB = best ]; then
  # the rows not run yet (the others have 3 CPU seeds each in reproductions/results.db)
  timeout $TO python3 reproductions/shard.py reproductions/fmnist_best_eps27.toml \
    --only ScatterNet+AugMult8 --only Yu+EMA+AugMult8 --only Yu+AugMult8 --only Yu+Aug+EMA \
    --db $W/best.db --work $W/w_best --jobs 4 --workers 1 "${COMMON[@]}" > $W/best.log 2>&1 &
  pids+=($!)
fi
if [ $JOB = lin ]; then
timeout $TO python3 reproductions/shard.py reproductions/xia_table2_tan.toml --db $W/xia.db \
  --work $W/w_xia --jobs 3 --workers 3 "${COMMON[@]}" > $W/xia.log 2>&1 &
pids+=($!)
fi
first=1
[ $JOB = lin ] || EPS=none
for e in ${EPS:-1.5 4.5}; do
  [ "$e" = none ] && continue
  if [ $MPS = 0 ] && [ $first = 0 ]; then continue; fi  # without MPS: the first level only
  first=0
  DPCLIP_SEARCH_WORKERS=5 timeout $TO python3 reproductions/shard.py \
    reproductions/lin_table2_tan.toml --set "grid.epsilons=[$e]" --db $W/lin${e/./}.db \
    --work $W/w_lin${e/./} --jobs 8 --workers 1 "${COMMON[@]}" > $W/lin${e/./}.log 2>&1 &
  pids+=($!)
done
wait "${pids[@]}"
kill $SMI 2>/dev/null
tail -n 4 $W/*.log
(cd /tmp && tar czf - gw) | split -b 15M - $OUT/gw.tgz.part_
ls -la $OUT
echo "done at $(( $(date +%s) - T0 )) s"
