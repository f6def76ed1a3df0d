#!/usr/bin/env bash
# The GPU checks behind the README's GPU numbers, run once on a lent H200 (tool library `device`):
#  1. throughput of RAPTOR-B (2 blocks) against its teacher DINOv2-B-reg, and of SAPER ViT-B k = 24
#     against DINOv2-B (bf16 autocast, batch 128, 224 px, interleaved);
#  2. full-size RAPTOR ViT-B training: every stage (phases, stage 1, stage 2, both probes) for one
#     short epoch on synthetic 224 px images, under Lightning on the GPU (bf16-mixed).
# The machine's python3 holds torch/lightning; vitexp's pure-Python needs (hydra, omegaconf, fvcore,
# timm, ...) travel in .gpu_site: `bash scripts/gpu_check.sh build` copies them from this machine's
# environment (one step, git-ignored; the device tool carries it: carry [".gpu_site"]).
# Before any row: the device's torch, CUDA, GPU name and bf16 support, and vitexp importable; a failure
# stops here. Every row carries its worst-case seconds and starts only when that fits in what is left of
# GPU_CHECK_BUDGET_S (default 540); else it is skipped with a message. --dry-run (after the set's name)
# prints each row's worst case and whether it would start, and runs nothing (tests/test_gpu_check.py).
# `bash scripts/gpu_check.sh 2` runs the second set instead:
#  3. throughput of BSPF-DeiT-S against DeiT-S and of RAPTOR-S against DINOv2-S-reg (bf16, batch 128);
#  4. a short full-size SAPER ViT-B k = 24 training run on synthetic images, whose deployed model's
#     throughput is timed on the GPU (bench.device=auto) at the end.
# `bash scripts/gpu_check.sh rehearse` runs the rehearsal (issue 28, vitexp/cost/rehearsal/) on the GPU instead:
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
# `bash scripts/gpu_check.sh compile` (also the first row of set 1, the default call):
#  8. eager against torch.compile (compile.enabled=true: each model timed eager and compiled, interleaved, its
#     first compiled call timed) for DeiT-S and each token method (BSPF-ViT, chunk-only, EViT, ToMe), bf16
#     autocast, batch 128, 224 px: the compiled/eager ratio, the compile time, and each method's speedup over
#     DeiT-S under compile beside its GMACs ratio (docs/measurements.md, "Compiled"; the CPU run's numbers there).
# Ledger entries go to $OUT/results/runs (copy its new files into results/runs afterwards).
set -uo pipefail
cd "$(dirname "$0")/.."
set_name=${1:-1}
dry=0; [ "${2:-}" = --dry-run ] && dry=1
budget=${GPU_CHECK_BUDGET_S:-540}
start=$SECONDS
if [ "$set_name" = build ]; then  # vitexp's pure-Python dependencies, copied from this environment
  rm -rf .gpu_site && mkdir .gpu_site
  python3 - .gpu_site <<'PY'
import importlib.metadata as md, shutil, sys
from pathlib import Path
dists = ["hydra-core", "omegaconf", "antlr4-python3-runtime", "hydra-submitit-launcher", "submitit", "cloudpickle",
         "timm", "huggingface-hub", "safetensors", "fvcore", "iopath", "yacs", "portalocker", "tabulate", "termcolor",
         "torchmetrics", "lightning-utilities"]
for name in dists:
    dist = md.distribution(name)
    for f in dist.files or []:
        src, dst = Path(dist.locate_file(f)), Path(sys.argv[1]) / f
        if src.is_file() and ".." not in f.parts:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
print(f"gpu_check: {len(dists)} distributions copied into {sys.argv[1]}")
PY
  exit $?
fi
export PYTHONPATH="$PWD/.gpu_site:$PWD" VITEXP_RESULTS="${OUT:-/tmp}/results" PYTHONUNBUFFERED=1 WANDB_MODE=disabled
left() { echo $(( budget - (SECONDS - start) )); }
# row WORST_S command...: runs the command when WORST_S fits in what is left (vitexp: SIGTERM at WORST_S - 10,
# SIGKILL 10 s later; a rehearsal: vitexp-sweep stops each of its rows at --rehearse-timeout, so WORST_S counts its rows)
row() {
  local worst=$1; shift
  if [ "$(left)" -lt "$worst" ]; then echo "gpu_check: skipped, needs up to ${worst} s, $(left) s left: $*"; return 0; fi
  if [ "$dry" = 1 ]; then echo "gpu_check: would run (up to ${worst} s, $(left) s left): $*"; start=$(( start - worst )); return 0; fi
  if declare -F "$1" >/dev/null; then "$@"; return; fi  # rehearse: vitexp-sweep bounds its own rows
  timeout -k 10 "$(( worst - 10 ))" "$@" logger=none 2>&1 | grep -v -i warn | tail -4 | cut -c1-1500  # SIGKILL 10 s after SIGTERM
}
vx=(python3 -m vitexp.commands.cli)
compiled_row() {  # 8.: the same comparison as the CPU's in docs/measurements.md, in bf16 on the GPU
  row 360 "${vx[@]}" bench 'bench.compare=[deit_small_baseline,bspf_deit_small,chunk_deit_small,evit_deit_small,tome_deit_small]' \
      compile.enabled=true bench.device=cuda bench.batch_size=128 bench.amp=true bench.rounds=5 bench.iters=10 bench.warmup=3
}
if [ "$dry" = 0 ]; then  # the device first: nothing starts on a machine that cannot run it
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || { echo "gpu_check: no nvidia-smi"; exit 1; }
  python3 - <<'PY' || exit 1
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} sees no CUDA device (built for CUDA {torch.version.cuda})")
name, bf16 = torch.cuda.get_device_name(0), torch.cuda.is_bf16_supported()
print(f"gpu_check: torch {torch.__version__}, CUDA {torch.version.cuda}, {name}, capability {torch.cuda.get_device_capability(0)}, bf16 {bf16}")
if not bf16:
    sys.exit(f"gpu_check: {name} has no bf16: the rows run bf16-mixed")
import vitexp.commands.cli, timm, lightning, hydra  # noqa: F401,E401  (what .gpu_site carries: `bash scripts/gpu_check.sh build`)
print("gpu_check: timm", timm.__version__, "lightning", lightning.__version__, "hydra", hydra.__version__)
PY
fi
case "$set_name" in
rehearse)
  mkdir -p "$VITEXP_RESULTS/runs"
  [ "$dry" = 1 ] || python3 - "$VITEXP_RESULTS/ledger/gpu-rehearsals.jsonl.gz" <<'PY'  # the committed GPU rehearsals, as a pack
import json, sys
from pathlib import Path
from vitexp.ledger import Ledger
from vitexp.ledger.sources import write_snapshot
done = [r for r in Ledger.load("results") if r["kind"] == "rehearsal" and '"device": "cuda' in json.dumps(r)]
if done:
    write_snapshot(done, Path(sys.argv[1]))
PY
  per_row=${REHEARSE_ROW_S:-150}  # a row's worst case: vitexp-sweep kills it then, and starts none that cannot end in time
  rehearse() { "${vx[@]}" sweep "$@" --rehearse --rehearse-batch 0 --rehearse-steps 3 --rehearse-timeout "$per_row" \
      --rehearse-dir "${OUT:-/tmp}/rehearsal" 2>&1 | grep '^vitexp-sweep: rehearsal\|^{' | cut -c1-400; }
  row "$per_row" rehearse bspf_table1 --rehearse-only deit_tiny_baseline --rehearse-trainer ddp
  row "$(( 2 * per_row ))" rehearse saper_table1 --rehearse-only saper_kd_vits14_k6_in1k,raptor_vits14_k2_in1k --rehearse-trainer ddp
  row "$per_row" rehearse bspf_coco --rehearse-only maskrcnn_shvit_s4_coco --rehearse-trainer ddp
  for table in bspf_table1 bspf_table2 bspf_coco saper_table1 bspf_table6 bspf_table7 bspf_table8 peers_deit_small saper_table2 demo; do
    row "$per_row" rehearse "$table" --rehearse-trainer gpu --rehearse-budget-s "$(( $(left) - 10 ))"
  done ;;
compile)
  compiled_row ;;
anchor)
  row 240 "${vx[@]}" bench bench.mode=train_step experiment=deit_small_baseline bench.device=cuda bench.batch_size=256 bench.amp=true \
      bench.rounds=5 bench.iters=10 bench.warmup=5 ;;
2)
  row 240 "${vx[@]}" bench experiment=bspf_deit_small bench.batch_size=128 bench.amp=true bench.rounds=5 bench.iters=10
  row 240 "${vx[@]}" bench experiment=raptor_dinov2 bench.batch_size=128 bench.amp=true bench.rounds=5 bench.iters=10
  row 300 "${vx[@]}" train experiment=saper_dinov2 backbone=dinov2_vitb14 budget.k=24 name=saper_ft_vitb14_k24_in1k data=synthetic \
      data.num_train=1024 data.num_val=128 data.num_test=256 recipe.epochs=2 recipe.batch_size=128 eval.throughput_batch=128 \
      bench.amp=true trainer.enable_progress_bar=false ;;
1)
  compiled_row
  row 240 "${vx[@]}" bench experiment=raptor_dinov2 backbone=dinov2_vitb14_reg bench.batch_size=128 bench.amp=true bench.rounds=5 bench.iters=10
  row 240 "${vx[@]}" bench experiment=saper_dinov2 backbone=dinov2_vitb14 budget.k=24 name=saper_ft_vitb14_k24_in1k bench.batch_size=128 \
      bench.amp=true bench.rounds=5 bench.iters=10
  row 300 "${vx[@]}" train experiment=raptor_dinov2 backbone=dinov2_vitb14_reg data=synthetic data.num_train=2048 data.num_val=128 \
      data.num_test=256 recipe.epochs=1 recipe.warmup_steps=8 method.probe.epochs=1 method.probe.batch_size=128 \
      method.phase_images=128 eval.throughput_batch=128 trainer.enable_progress_bar=false ;;
*) echo "usage: $0 [1|2|compile|rehearse|anchor|build] [--dry-run]" >&2; exit 2 ;;
esac
[ "$dry" = 1 ] || nvidia-smi --query-gpu=memory.used --format=csv,noheader
