#!/usr/bin/env bash
# One prepared device call for issues 31 and 32 (a lease is 15 minutes of device time, all calls
# together: this script keeps itself under BUDGET seconds, default 555, and packs what it has
# after every part). Run from the project root on the GPU machine, laid out as
# ../shared/gpu/run.sh expects: the kit in .gpu/ (for opacus_fmnist.py), wheels of dp-accounting,
# dm-tree, opacus and mlxtend in .whl/, the Fashion-MNIST IDX files in .data/fmnist/.
# The lent machines have transformers 5.17, which decides with `mask.all()` whether any row has
# padding in its SDPA / causal mask helpers (Llama refused there); CI runs 5.25. So .whl/ also
# holds transformers 5.25 and what it needs (about 21 MB):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any \
#     transformers==5.25.0 huggingface_hub==2.4.0 tokenizers==0.23.3 regex==2026.11.19 \
#     safetensors==0.8.0 kernels==0.19.1 -d .whl
#   D0 BERT-base on engine "compiled" (the proof's graph run instead of the model's code) against
#      ghost (auto), Opacus ghost and hooks, non-private (benchmarks/hf_models.py --models bert)
#   A2 benchmarks/proof_diagnose.py: the full export error and the guard that specialised the
#      batch (torch 2.11 refused every HF model with "Constraints violated"), then the same export
#      with an upper bound on the batch and with the model on the CPU
#   G  benchmarks/physical_batch.py: `dpclip train` at chunks of 256 against the whole batch (the
#      default since 0.3; 58.5 ms a step at 256 against 14.3 ms for make_private's whole batch)
#   C  Tramer-Boneh Fashion-MNIST (Papernot CNN, B 2048, eps 2.7, 40 epochs), seed 0, alone on
#      the card: `dpclip train --device cuda --eval-every 0` (train_seconds), then Opacus
#   D  the four ~100M-parameter Hugging Face models (benchmarks/hf_models.py --size base), with
#      engine "compiled" beside auto (BERT, GPT-2 and Llama run on it; ViT is refused)
#   C2 benchmarks/step_profile.py: a private step against a non-private one, profiler tables
#   E  `dpclip bench --model transformer --batch-size 256` against Opacus ghost
#   F  if time is left: BERT with the default (SDPA) attention, to see the verdict on GPU kernels
#   B  (SKIP_B=0) noise per step: 1M and 109M parameters (benchmarks/gpu_noise.py)
#   A  if time is left: the CUDA tests (Philox keyed from os.urandom, resume, re-keying, float64
#      noise on the device, make_private keeping data and masks on the GPU)
# Everything lands in $OUT/gpu_session.tgz (results to be copied into benchmarks/results/).
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
BUDGET=${BUDGET:-555}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
cap() { local want=$1 l; l=$(( $(left) - ${2:-15} )); [ "$l" -lt "$want" ] && want=$l; [ "$want" -lt 1 ] && want=1; echo "$want"; }
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
W=/tmp/gs; rm -rf "$W"; mkdir -p "$W"
pack() { tar czf "$OUT/gpu_session.tgz" -C /tmp gs 2>/dev/null; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD/src:$PWD
nvidia-smi -L | tee "$W/device.txt"
python3 -c "import torch, transformers, opacus; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'opacus', opacus.__version__)" | tee -a "$W/device.txt"
TRAIN=(python3 -m dpclip train --dataset fashion-mnist --data-dir .data/fmnist --model papernot-cnn
       --strategy fixed --param clip_norm=0.1 --epsilon 2.7 --delta 1e-5 --epochs 40
       --batch-size 2048 --lr 4 --optimizer momentum --device cuda --eval-every 0 --no-progress
       --json)
summary() {  # the last stdout line of `dpclip train --json` is the summary
  python3 - "$1" <<'EOF'
import json, sys
try:
    lines = [ln for ln in open(sys.argv[1]).read().splitlines() if ln.strip()]
    s = json.loads(lines[-1])
    print({k: s.get(k) for k in ("seed", "test_accuracy", "epsilon", "train_seconds",
                                 "wall_seconds", "device", "generator", "engine", "engine_fallback")})
except Exception as exc:  # noqa: BLE001
    print("no summary:", exc)
EOF
}

echo "== D0: BERT-base on the compiled engine against ghost, auto and Opacus ($(left) s left)"
timeout "$(cap 150 90)" python3 benchmarks/hf_models.py --device cuda --size base --rounds 5 \
  --warm 3 --models bert --methods nonprivate,dpclip-auto,dpclip-compiled,opacus-ghost,opacus-hooks \
  --out "$W/hf_models_compiled_cuda.json" > "$W/hf_models_compiled.log" 2>&1
echo "hf compiled rc $?"; cat "$W/hf_models_compiled_cuda.md" 2>/dev/null | cut -c1-400
grep -v "^|" "$W/hf_models_compiled.log" | tail -n 8
pack

echo "== A2: why the proof refuses the HF models on this torch ($(left) s left)"
timeout "$(cap 90)" python3 benchmarks/proof_diagnose.py --device cuda --size base --layers 1 --models bert,vit \
  > "$W/proof_diagnose.txt" 2>&1
echo "diagnose rc $?"; grep -E "^== |^-- |guard added|set_replacement" "$W/proof_diagnose.txt" | cut -c1-300 | head -40
pack

echo "== G: dpclip train's physical batch, 256 vs the whole batch (3 epochs) ($(left) s left)"
timeout "$(cap 60)" python3 benchmarks/physical_batch.py --device cuda --epochs 3 --rounds 1 \
  > "$W/physical_batch.log" 2>&1
echo "rc $?"; tail -n 4 "$W/physical_batch.log"; cp benchmarks/results/physical_batch_cuda.* "$W/" 2>/dev/null
pack

echo "== C: Fashion-MNIST seed 0, dpclip then Opacus, alone on the card ($(left) s left)"
timeout "$(cap 120)" "${TRAIN[@]}" --seed 0 --db "$W/runs_0.db" > "$W/dpclip_fmnist_0.json" \
  2> "$W/dpclip_fmnist_0.err"
echo "dpclip rc $?"; summary "$W/dpclip_fmnist_0.json"; tail -n 3 "$W/dpclip_fmnist_0.err"
timeout "$(cap 100)" python3 .gpu/opacus_fmnist.py .data/fmnist "$W/opacus_fmnist_0.json" 40 \
  > "$W/opacus_fmnist_0.log" 2>&1
echo "opacus rc $?"; cat "$W/opacus_fmnist_0.json" 2>/dev/null | head -c 800; echo
pack

echo "== D: Hugging Face models, base size ($(left) s left)"
timeout "$(cap 230 90)" python3 benchmarks/hf_models.py --device cuda --size base --rounds 5 \
  --warm 3 --methods nonprivate,dpclip-auto,dpclip-compiled,opacus-ghost,opacus-hooks \
  --out "$W/hf_models_cuda.json" > "$W/hf_models.log" 2>&1
echo "hf rc $?"; cat "$W/hf_models_cuda.md" 2>/dev/null | cut -c1-400; grep -v "^|" "$W/hf_models.log" | tail -n 8
pack

echo "== C2: where a private step spends its time (profiler, Papernot CNN B 2048) ($(left) s left)"
timeout "$(cap 60)" python3 benchmarks/step_profile.py --device cuda --batch 2048 --steps 20 \
  --out "$W" > "$W/step_profile.log" 2>&1
echo "step profile rc $?"; head -c 2500 "$W/step_profile.log"; echo
pack

echo "== E: dpclip bench transformer 256 ($(left) s left)"
timeout "$(cap 80)" python3 -m dpclip bench --model transformer --batch-size 256 --device cuda \
  --steps 30 --method nonprivate --method dpclip-ghost --method opacus-ghost --json \
  > "$W/bench_transformer_256.json" 2> "$W/bench.err"
echo "bench rc $?"; head -c 2500 "$W/bench_transformer_256.json"; echo; tail -n 3 "$W/bench.err"
pack

if [ "$(left)" -gt 70 ]; then
  echo "== F: BERT with SDPA attention ($(left) s left)"
  timeout "$(cap 90)" python3 benchmarks/hf_models.py --device cuda --size base --rounds 3 \
    --warm 1 --models bert --attn sdpa --out "$W/hf_models_cuda_sdpa.json" > "$W/hf_sdpa.log" 2>&1
  echo "sdpa rc $?"; cat "$W/hf_models_cuda_sdpa.md" 2>/dev/null | cut -c1-400
  pack
fi
if [ "${SKIP_B:-1}" = 0 ]; then
echo "== B: noise per step ($(left) s left)"
timeout "$(cap 60)" python3 benchmarks/gpu_noise.py --device cuda --sizes 1e6,1.09e8 \
  --repeats 10,10 --out "$W" > "$W/noise.log" 2>&1
echo "noise rc $?"; cat "$W"/noise_cuda.md 2>/dev/null | tail -n 14; tail -n 3 "$W/noise.log"
pack

fi
if [ "$(left)" -gt 45 ]; then
  echo "== A: CUDA tests ($(left) s left)"
  timeout "$(cap 120)" python3 -m pytest -q -p no:cacheprovider -rs -k "cuda or CUDA" \
    tests/core/test_devices.py tests/core/test_noise.py tests/engine/test_memory_watch.py \
    tests/engine/test_exact_float32.py tests/distributed/test_noise_shard.py \
    > "$W/tests_cuda.txt" 2>&1
  echo "tests rc $?"; tail -n 25 "$W/tests_cuda.txt"
  pack
fi
ls -la "$W" "$OUT"; echo "done at $(( $(date +%s) - T0 )) s"
