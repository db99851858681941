#!/usr/bin/env bash
# Second device call of the 2026-12-04 (seventh) session, after the first (gpu_session.sh) showed
# torch 2.11's C++ matmul specialising the proof's symbolic batch (fixed by the proof's own
# symbolic matmul, batch_symbol._matmul_as_eager) and BERT on ghost at 1660 ms a step:
#   P  benchmarks/hf_profile.py: where BERT-base's ghost step spends its time (Python stack
#      samples, torch.profiler), SDPA attention as in the 1660 ms row
#   Q  benchmarks/step_profile.py: the Papernot CNN B 2048 private step (Fashion-MNIST cell)
#   D  the four ~100M-parameter Hugging Face models (eager attention) with the fix
# Layout as gpu_session.sh; everything lands in $OUT/gpu_followup2.tgz.
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
BUDGET=${BUDGET:-330}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
cap() { local want=$1 l; l=$(( $(left) - ${2:-10} )); [ "$l" -lt "$want" ] && want=$l; [ "$want" -lt 1 ] && want=1; echo "$want"; }
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
W=/tmp/gf; rm -rf "$W"; mkdir -p "$W"
pack() { tar czf "$OUT/gpu_followup2.tgz" -C /tmp gf 2>/dev/null; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD/src:$PWD
nvidia-smi -L | tee "$W/device.txt"

echo "== P: BERT-base ghost step profile ($(left) s left)"
timeout "$(cap 70)" python3 benchmarks/hf_profile.py --device cuda --model bert --size base \
  --attn sdpa --steps 4 > "$W/hf_profile_bert.txt" 2>&1
echo "rc $?"; head -c 5000 "$W/hf_profile_bert.txt"; echo
pack

echo "== Q: Papernot CNN B 2048 step profile ($(left) s left)"
timeout "$(cap 50)" python3 benchmarks/step_profile.py --device cuda --batch 2048 --steps 10 \
  --out "$W" > "$W/step_profile.log" 2>&1
echo "rc $?"; head -c 4000 "$W/step_profile.log"; echo
pack

echo "== D: Hugging Face models, base size ($(left) s left)"
timeout "$(cap 220 5)" python3 benchmarks/hf_models.py --device cuda --size base --rounds 4 \
  --warm 1 --out "$W/hf_models_cuda.json" > "$W/hf_models.log" 2>&1
echo "hf rc $?"; cut -c1-330 "$W/hf_models_cuda.md" 2>/dev/null; grep -v "^|" "$W/hf_models.log" | grep -v "^{" | tail -n 5
pack
echo "done at $(( $(date +%s) - T0 )) s"
