#!/usr/bin/env bash
# Second, short device call of a lease (after benchmarks/gpu_session.sh): the Hugging Face models
# again after a fix, `dpclip bench` on the Fashion-MNIST cell (Papernot CNN, B 2048) against Opacus
# ghost, and a cProfile of `dpclip train --device cuda` (2 epochs of the Tramer-Boneh setting) to
# see the per-step Python of the end-to-end run. Same layout as gpu_session.sh; BUDGET seconds.
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s); BUDGET=${BUDGET:-280}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
cap() { local want=$1 l; l=$(( $(left) - ${2:-10} )); [ "$l" -lt "$want" ] && want=$l; [ "$want" -lt 1 ] && want=1; echo "$want"; }
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; W=/tmp/gf; rm -rf "$W"; mkdir -p "$W"
pack() { tar czf "$OUT/gpu_followup.tgz" -C /tmp gf 2>/dev/null; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD/src:$PWD
echo "== HF models ($(left) s left)"
timeout "$(cap 130 120)" python3 benchmarks/hf_models.py --device cuda --size base --rounds 5 \
  --warm 2 --out "$W/hf_models_cuda.json" > "$W/hf_models.log" 2>&1
echo "hf rc $?"; cut -c1-330 "$W/hf_models_cuda.md" 2>/dev/null; pack
echo "== bench papernot-cnn 2048 ($(left) s left)"
timeout "$(cap 50 70)" python3 -m dpclip bench --model papernot-cnn --batch-size 2048 --device cuda \
  --steps 20 --method nonprivate --method dpclip-ghost --method opacus-ghost --json \
  > "$W/bench_cnn_2048.json" 2> "$W/bench.err"
echo "bench rc $?"; python3 -c "
import json; [print(r['method'], round(r['ms_per_step'], 2), round(r['ratio_to_nonprivate'], 2), round(r.get('peak_mem_mb') or 0)) for r in json.load(open('$W/bench_cnn_2048.json'))]" 2>&1 | tail -4; pack
echo "== cProfile dpclip train, 2 epochs ($(left) s left)"
timeout "$(cap 60 5)" python3 -m cProfile -o "$W/train.prof" -m dpclip train --dataset fashion-mnist \
  --data-dir .data/fmnist --model papernot-cnn --strategy fixed --param clip_norm=0.1 --epsilon 2.7 \
  --delta 1e-5 --epochs 2 --batch-size 2048 --lr 4 --optimizer momentum --device cuda \
  --eval-every 0 --no-progress --json --db "$W/runs.db" > "$W/train.json" 2> "$W/train.err"
echo "train rc $?"; tail -c 400 "$W/train.json"
python3 -c "
import pstats; p = pstats.Stats('$W/train.prof'); p.sort_stats('tottime').print_stats(22)" > "$W/prof_tottime.txt" 2>&1
python3 -c "
import pstats; p = pstats.Stats('$W/train.prof'); p.sort_stats('cumulative').print_stats(40)" > "$W/prof_cum.txt" 2>&1
grep -A30 "ncalls" "$W/prof_tottime.txt" | cut -c1-160 | head -26; pack
echo "done at $(( $(date +%s) - T0 )) s"
