#!/usr/bin/env bash
# Issue 32 device check (GPU-native private step), prepared on a CPU-only session: run it on a GPU
# machine from the project root, laid out as /work/shared/gpu/run.sh expects (the kit copied to
# .gpu/, wheels of dp-accounting, dm-tree, opacus, mlxtend in .whl/, the Fashion-MNIST IDX files in
# .data/fmnist/). OUT is the results folder (default ./gpu-out; on the device tool: $OUT).
# About 4-6 minutes on an H100/H200 with SEEDS="0" (set SEEDS="0 1 2" for the 3-seed figure).
#   part 1: the CUDA tests (skipped on the CPU): Philox keyed from os.urandom, resume on CUDA,
#           re-keying, float64 noise on the device, make_private keeping data/masks on the GPU
#   part 2: noise per step, float32 vs float64-then-cast vs the old CPU-draw-and-copy, 1M/10M/109M
#           -> $OUT/noise_cuda.json / .md (copy into benchmarks/results/)
#   part 3: Tramer-Boneh Fashion-MNIST (Papernot CNN, B 2048, eps 2.7, 40 epochs) on the same card:
#           dpclip train --device cuda --eval-every 0 (train_seconds in the summary) vs Opacus
#           (s_total: its training loop), per seed
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
SEEDS=${SEEDS:-0}
if ls .whl/*.whl >/dev/null 2>&1; then
  SITE=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || exit 1
  export PYTHONPATH=$SITE:$PWD/src:$PWD
else
  export PYTHONPATH=$PWD/src:$PWD
fi
nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
echo "== part 1: CUDA tests"
timeout 180 python3 -m pytest -q -p no:cacheprovider tests/core/test_devices.py tests/core/test_noise.py 2>&1 | tail -15
echo "== part 2: noise per step on the GPU"
timeout 120 python3 benchmarks/gpu_noise.py --device cuda --repeats 20 --out "$OUT" 2>&1 | tail -12
cat "$OUT/noise_cuda.md" 2>/dev/null
for seed in $SEEDS; do
  echo "== part 3: seed $seed: dpclip train --device cuda"
  timeout 150 python3 -m dpclip train --dataset fashion-mnist --data-dir .data/fmnist --model papernot-cnn \
    --strategy fixed --param clip_norm=0.1 --epsilon 2.7 --delta 1e-5 --epochs 40 --batch-size 2048 \
    --lr 4 --optimizer momentum --device cuda --eval-every 0 --seed "$seed" --no-progress --json \
    --db "$OUT/runs.db" > "$OUT/dpclip_fmnist_$seed.json" 2>> "$OUT/err.log"
  echo "rc $?"
  python3 - "$OUT/dpclip_fmnist_$seed.json" <<'EOF'
import json, sys
try:
    lines = [ln for ln in open(sys.argv[1]).read().splitlines() if ln.strip()]
    s = json.loads(lines[-1])  # --json: the last stdout line is the summary
    print({k: s.get(k) for k in ("test_accuracy", "epsilon", "train_seconds", "wall_seconds",
                                 "device", "generator", "engine")})
except Exception as exc:  # noqa: BLE001
    print("no summary:", exc)
EOF
  if [ -f .gpu/opacus_fmnist.py ]; then
    echo "== part 3: seed $seed: Opacus"
    timeout 120 python3 .gpu/opacus_fmnist.py .data/fmnist "$OUT/opacus_fmnist_$seed.json" 40 2>> "$OUT/err.log"
    echo "rc $?"; cat "$OUT/opacus_fmnist_$seed.json" 2>/dev/null; echo
  fi
done
