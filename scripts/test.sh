#!/usr/bin/env bash
# The test suite on a fresh machine, in one command:
#   bash scripts/test.sh          # install into .venv, check the floors (lint-imports), run the default tests
#   bash scripts/test.sh --all    # ... then the tests marked `slow` too (what CI runs: .ci/run)
# The default run leaves out the tests marked `slow` (pyproject.toml: addopts = -m "not slow"): the long
# integration runs and the largest property sweeps. CONTRIBUTING.md lists them and what they cost.
# Further arguments go to pytest. Set SNLP_NO_VENV=1 to install into the current Python instead of .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
all=0
if [[ "${1:-}" == "--all" ]]; then all=1; shift; fi
source scripts/setup_env.sh
snlp_setup smollm2
python3 -c "from importlinter.cli import lint_imports_command; lint_imports_command()"
# The default tests on every core (pytest-xdist; at most 4 workers, each loads SmolLM2 once); `-n 0` among the
# arguments runs them in one process. The slow ones stay in one process: whole pipelines, some timing wall clocks.
workers=$(python3 -c "import os; print(min(4, len(os.sched_getaffinity(0))))")
python3 -m pytest -q -n "$workers" "$@"
if (( all )); then
    rc=0; python3 -m pytest -q -n 0 -m slow "$@" || rc=$?
    (( rc == 0 || rc == 5 )) || exit $rc   # 5: no slow test among the paths given
fi
