#!/usr/bin/env bash
# The GPU checks behind the README's GPU numbers, run once on a lent H200 (tool library `device`):
#  1. throughput of RAPTOR-B (2 blocks) against its teacher DINOv2-B-reg, and of SAPER ViT-B k = 24
#     against DINOv2-B (bf16 autocast, batch 128, 224 px, interleaved);
#  2. full-size RAPTOR ViT-B training: every stage (phases, stage 1, stage 2, both probes) for one
#     short epoch on synthetic 224 px images, under Lightning on the GPU (bf16-mixed).
# The machine's python3 holds torch/lightning; vitexp's pure-Python needs (hydra, omegaconf, fvcore,
# timm 1.0.31, ...) travel in .gpu_site (copied from a local venv's site-packages, git-ignored).
# `bash scripts/gpu_check.sh 2` runs the second set instead:
#  3. throughput of BSPF-DeiT-S against DeiT-S and of RAPTOR-S against DINOv2-S-reg (bf16, batch 128);
#  4. a short full-size SAPER ViT-B k = 24 training run on synthetic images, whose deployed model's
#     throughput is timed on the GPU (bench.device=auto) at the end.
# `bash scripts/gpu_check.sh rehearse` runs the rehearsal (issue 28, vitexp/rehearsal/) on the GPU instead:
#  5. one full-size row per objective (DeiT-T fine-tune, SAPER distill with its k-NN, RAPTOR's four stages,
#     Mask R-CNN at 1280 x 800) under DDP on one device (trainer=ddp, devices=1), the recipe's per-device
#     batch, bf16-mixed, 3 steps per stage;
#  6. then every row of the paper-scale tables on the GPU (trainer=gpu, the recipe's batch, bf16-mixed),
#     table by table, until REHEARSE_BUDGET_S (default 420 s) has passed: the rows not reached are listed
#     in each table's closing line (status partial). The GPU rehearsals already in the ledger are
#     copied in first, so a later session skips them and goes on where this one stopped.
#  The entries (kind rehearsal, device cuda:...) are what vitexp/cost/ measures GPU-hours from.
# `bash scripts/gpu_check.sh anchor` measures the GPU itself instead (issue 43):
#  7. DeiT-S's training step (vitexp-bench bench.mode=train_step experiment=deit_small_baseline: AdamW, bf16
#     autocast, batch 256, synthetic 224 px images, median of 5 rounds of 10 steps). That rate over timm's
#     DeiT-S rate on the RTX 3090 becomes the GPU's factor (vitexp/cost/anchors.py gpu_factors), in place of the
#     vendor table's; then every table's cost on that GPU: vitexp-tables with conf/cost.yaml target_gpu set to it.
# Ledger entries go to $OUT/results/runs (copy its new files into results/runs afterwards).
set -uo pipefail
export PYTHONPATH="$PWD/.gpu_site:$PWD" VITEXP_RESULTS="$OUT/results" PYTHONUNBUFFERED=1 WANDB_MODE=disabled
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, timm, lightning; print('torch', torch.__version__, 'timm', timm.__version__, 'lightning', lightning.__version__)"
run() { timeout 240 python3 -m vitexp.cli "$@" logger=none 2>&1 | grep -v -i warn | tail -4 | cut -c1-1500; }
if [ "${1:-1}" = rehearse ]; then
  mkdir -p "$OUT/results/runs"
  python3 - "$OUT/results/ledger/gpu-rehearsals.jsonl.gz" <<'PY'  # the committed GPU rehearsals, as a pack
import json, sys
from pathlib import Path
from vitexp.ledger import Ledger
from vitexp.ledger.sources import write_snapshot
done = [r for r in Ledger.load("results") if r["kind"] == "rehearsal" and '"device": "cuda' in json.dumps(r)]
if done:
    write_snapshot(done, Path(sys.argv[1]))
PY
  start=$SECONDS
  rehearse() { python3 -m vitexp.cli sweep "$@" --rehearse --rehearse-batch 0 --rehearse-steps 3 --rehearse-timeout 300 \
      --rehearse-dir "$OUT/rehearsal" 2>&1 | grep '^vitexp-sweep: rehearsal\|^{' | cut -c1-400; }
  rehearse bspf_table1 --rehearse-only deit_tiny_baseline --rehearse-trainer ddp
  rehearse saper_table1 --rehearse-only saper_kd_vits14_k6_in1k,raptor_vits14_k2_in1k --rehearse-trainer ddp
  rehearse bspf_coco --rehearse-only maskrcnn_shvit_s4_coco --rehearse-trainer ddp
  for table in bspf_table1 bspf_table2 bspf_coco saper_table1 bspf_table6 bspf_table7 bspf_table8 peers_deit_small saper_table2 demo; do
    left=$(( ${REHEARSE_BUDGET_S:-420} - (SECONDS - start) ))
    [ "$left" -gt 30 ] || { echo "budget spent: $table and later tables not started"; break; }
    rehearse "$table" --rehearse-trainer gpu --rehearse-budget-s "$left"
  done
  nvidia-smi --query-gpu=memory.used --format=csv,noheader
  exit 0
fi
if [ "${1:-1}" = anchor ]; then
  run bench bench.mode=train_step experiment=deit_small_baseline bench.device=cuda bench.batch_size=256 bench.amp=true \
      bench.rounds=5 bench.iters=10 bench.warmup=5
  nvidia-smi --query-gpu=memory.used --format=csv,noheader
  exit 0
fi
if [ "${1:-1}" = 2 ]; then
  run bench experiment=bspf_deit_small bench.batch_size=128 bench.amp=true bench.rounds=5 bench.iters=10
  run bench experiment=raptor_dinov2 bench.batch_size=128 bench.amp=true bench.rounds=5 bench.iters=10
  run train experiment=saper_dinov2 backbone=dinov2_vitb14 budget.k=24 name=saper_ft_vitb14_k24_in1k data=synthetic data.num_train=1024 data.num_val=128 data.num_test=256 \
      recipe.epochs=2 recipe.batch_size=128 eval.throughput_batch=128 bench.amp=true trainer.enable_progress_bar=false
  nvidia-smi --query-gpu=memory.used --format=csv,noheader
  exit 0
fi
run bench experiment=raptor_dinov2 backbone=dinov2_vitb14_reg bench.batch_size=128 bench.amp=true bench.rounds=5 bench.iters=10
run bench experiment=saper_dinov2 backbone=dinov2_vitb14 budget.k=24 name=saper_ft_vitb14_k24_in1k bench.batch_size=128 bench.amp=true bench.rounds=5 bench.iters=10
run train experiment=raptor_dinov2 backbone=dinov2_vitb14_reg data=synthetic data.num_train=2048 data.num_val=128 data.num_test=256 \
    recipe.epochs=1 recipe.warmup_steps=8 method.probe.epochs=1 method.probe.batch_size=128 method.phase_images=128 \
    eval.throughput_batch=128 trainer.enable_progress_bar=false
nvidia-smi --query-gpu=memory.used --format=csv,noheader
