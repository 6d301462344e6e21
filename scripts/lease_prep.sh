#!/usr/bin/env bash
# What a GPU lease carries, made on the CPU before the first device call (docs/gpu.md, "Running the campaign on a
# short lease"). The lent machine reaches no registry and no hub, and the ignored folders below do not outlive a
# development box, so a fresh clone runs this first:
#
#   bash scripts/lease_prep.sh             # .paper/ (the paper's code) and runs/sr-idn/ (the decode part's model)
#   bash scripts/lease_prep.sh --alpha     # ... and its two drafters' acceptance on 48 held-out prompts (~8 min)
#
# runs/sr-idn is the speedrun's IDN-Reg model (depth 16, width 128, head dim 32, vocab 4096, T = 256, batch 8, IDN
# regulariser N = 12, lambda 0.5, seed 0, stdlib text) at 444 optimizer steps: taken from runs/speedrun/idn when a
# speedrun trained exactly that many steps with no time budget (`--steps 444`), else trained here with `snlp train`
# and the speedrun's settings (snlp.apps.speedrun.train.train_config), 444 steps on one intra-op thread, as the
# speedrun trains it (about 13 min on an idle core). config.json, model.safetensors and tokenizer.json (34 MB) are
# what the decode part loads, prompts.json the 48 held-out prompts it decodes; train_summary.json and train_state.pt
# (the run's settings, 16 KB) come along.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
ALPHA=0
for a in "$@"; do
  case "$a" in
    --alpha) ALPHA=1 ;;
    *) echo "lease_prep: unknown argument $a (use --alpha)" >&2; exit 2 ;;
  esac
done
STEPS=444
DST=runs/sr-idn

if [ ! -f .paper/nanochat-snlp/nanochat/gpt.py ]; then
  src=../shared/anchors/nanochat-snlp
  [ -f "$src/nanochat/gpt.py" ] || { echo "lease_prep: no checkout of the paper's code at $src" >&2; exit 1; }
  mkdir -p .paper && cp -r "$src" .paper/
fi
echo "lease_prep: .paper/nanochat-snlp ready"

steps_of() {  # the optimizer steps a checkpoint folder was trained for with no time budget and the settings below
  python3 - "$1" <<'EOF'  # (0 otherwise: a budgeted run that stopped at the same step had another learning-rate
import json, sys  # schedule; a run of another shape, seed, data or regulariser is another model)
from pathlib import Path
import torch
# the speedrun's IDN-Reg settings, as `snlp train` below and snlp.apps.speedrun.train.train_config record them
SETTINGS = {"data": "stdlib", "vocab_size": 4096, "depth": 16, "width": 128, "head_dim": 32, "seq_len": 256,
            "batch_size": 8, "seed": 0, "reg": "idn", "reg_n": "12", "reg_lambda": 0.5}
d = Path(sys.argv[1])
try:
    args = torch.load(d / "train_state.pt", map_location="cpu", weights_only=False).get("args", {})
    steps = json.loads((d / "train_summary.json").read_text()).get("steps", 0)
except (OSError, ValueError, AttributeError):
    args, steps = {}, 0
same = all(str(args.get(k)) == str(v) for k, v in SETTINGS.items())
print(steps if same and args.get("minutes") is None and args.get("steps") == steps else 0)
EOF
}

if [ -f "$DST/model.safetensors" ] && [ "$(steps_of "$DST")" != "$STEPS" ]; then
  # a folder from other settings (steps, time budget, shape, seed, data, regulariser; or without its train_state.pt /
  # train_summary.json) would be carried to the GPU as the lease's model, and its alpha would not be the
  # prediction's: refuse it, never delete it
  echo "lease_prep: $DST holds a model not trained by this script ($STEPS steps, no time budget, the speedrun's IDN-Reg settings): move it away" >&2
  exit 1
fi
if [ ! -f "$DST/model.safetensors" ]; then
  src=""
  if [ -f runs/speedrun/idn/model.safetensors ] && [ "$(steps_of runs/speedrun/idn)" = "$STEPS" ]; then
    src=runs/speedrun/idn
  else
    src=runs/sr-idn-train
    echo "lease_prep: training the speedrun's IDN-Reg model, $STEPS steps, into $src (resumes if interrupted)"
    OMP_NUM_THREADS=1 python3 -m snlp train --out "$src" --data stdlib --vocab-size 4096 --depth 16 --width 128 \
        --head-dim 32 --seq-len 256 --batch-size 8 --seed 0 --reg idn --reg-n 12 --reg-lambda 0.5 --steps "$STEPS" \
        --eval-every 100 --save-every 100 --log-every 1 --device cpu --no-progress \
        $([ -f "$src/model.safetensors" ] && echo --resume)
  fi
  mkdir -p "$DST"
  cp "$src/config.json" "$src/model.safetensors" "$src/tokenizer.json" "$DST/"
  for f in train_summary.json train_state.pt; do  # the run's settings: alpha_held_out reads its validation split
    if [ -f "$src/$f" ]; then cp "$src/$f" "$DST/"; fi
  done
fi
# the 48 held-out prompts --alpha measures (seed 1234): call 1 decodes these (--prompts-file), so the GPU's alpha is
# taken on the prompts the prediction's alpha came from
nice -n 5 python3 scripts/alpha_held_out.py "$DST" --write-prompts "$DST/prompts.json" --threads 1
echo "lease_prep: $DST ready ($(du -sh "$DST" | cut -f1)), model.safetensors sha256 $(sha256sum "$DST/model.safetensors" | cut -c1-16)..."
if [ "$ALPHA" = 1 ]; then
  for plan in 16xF1-h0-K3 12xF1-h0-K1; do  # the lease's two drafters, in the order call 1 decodes them
    nice -n 5 python3 scripts/alpha_held_out.py "$DST" --plan $plan --blocks 4,8 --dtypes float32 \
        --json "$DST/alpha-$plan.json"
  done
fi
