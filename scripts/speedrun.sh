#!/usr/bin/env bash
# The main job on a fresh machine, in one command (after nanochat's runs/speedrun.sh):
#   bash scripts/speedrun.sh                 # install into .venv, then `snlp speedrun --out runs/speedrun`
#   bash scripts/speedrun.sh --budget 30     # any further arguments go to `snlp speedrun` (docs/speedrun.md)
# It trains two depth-16 models (plain and IDN-regularised) inside a 20-minute budget, evaluates the paper's plans
# on both, decodes, and writes runs/speedrun/report.md. Set SNLP_NO_VENV=1 to install into the current Python
# instead of .venv (an environment you manage yourself).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
case " $* " in  # the SmolLM2 GGUF only for the opt-in off-the-shelf stage, which loads it (argparse also takes
  *" --of"*) snlp_setup smollm2 ;;  # its abbreviations, --of, --off-the, ...: no other flag starts with --of)
  *) snlp_setup ;;
esac
# Not `exec`: the run's clock starts at its Python process's start (snlp.apps.speedrun.job.process_age), and an
# exec'd process keeps this script's start, which would charge the install above to the budget.
python3 -m snlp.apps.cli speedrun --out "${SNLP_OUT:-runs/speedrun}" "$@"
