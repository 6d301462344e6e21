#!/usr/bin/env bash
# The GPU campaign: everything a lent GPU should measure, in one call of at most 8 minutes, read top to bottom.
#
#   bash scripts/gpu_campaign.sh [--quick] [--out DIR] [--paper PATH] [--parts a,b,...] [--decode-ckpt CKPT]
#                                [--decode-plans P,...] [--decode-drafter DIR] [--decode-prompts FILE]
#
# Each part runs in its own process under its own time limit, so a crash or a hang costs that part only; the
# parts write JSON under DIR/parts/, and the last step merges them into DIR/campaign.json and DIR/campaign.md
# and prints the table last (a device call returns the tail of its output). --quick is the CPU smoke run CI
# keeps green (tests/bench/test_campaign.py), so a lent GPU is never spent on a crash. A part run again into the same
# DIR first moves the earlier call's output of it to DIR/earlier/PART/; SIGINT / SIGTERM / SIGHUP to this script stop
# the running part's process group, and the table of what finished is still printed (exit 128 + the signal's number).
#
# On a lent GPU (from the repo root, the paper's code copied into the ignored .paper/ and carried):
#   mkdir -p .paper && cp -r ../shared/anchors/nanochat-snlp .paper/
#   device run: PYTHONUNBUFFERED=1 bash scripts/gpu_campaign.sh --out $OUT     (carry: .paper)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

QUICK=0; OUT=runs/gpu-campaign; PAPER=""; PARTS=""; DCKPT=random-smollm2; DPLANS=""; DDRAFTER=""; DPROMPTS=""
DFLAGS=""  # the --decode-* flags given: they set the decode part only
while [ $# -gt 0 ]; do
  case "$1" in
    --out|--paper|--parts|--decode-ckpt|--decode-plans|--decode-drafter|--decode-prompts)
      # a value that is the next flag (`--out --quick`) would be taken as the value and that flag lost
      [ $# -ge 2 ] && [[ "$2" != --* ]] || { echo "gpu_campaign: $1 needs a value (got ${2:-nothing})" >&2; exit 2; } ;;&
    --quick) QUICK=1 ;;
    --out) OUT="$2"; shift ;;
    --paper) PAPER="$2"; shift ;;
    --parts) PARTS="$2"; shift ;;
    --decode-ckpt) DCKPT="$2"; DFLAGS="$DFLAGS --decode-ckpt"; shift ;;
    --decode-plans) DPLANS="$2"; DFLAGS="$DFLAGS --decode-plans"; shift ;;
    --decode-drafter) DDRAFTER="$2"; DFLAGS="$DFLAGS --decode-drafter"; shift ;;  # an adapted drafter of --decode-ckpt (snlp adapt): its own rows
    --decode-prompts) DPROMPTS="$2"; DFLAGS="$DFLAGS --decode-prompts"; shift ;;  # a JSON list of prompts (snlp bench --prompts-file)
    *) echo "gpu_campaign: unknown argument $1 (use --quick, --out DIR, --paper PATH, --parts LIST, --decode-ckpt CKPT," \
            "--decode-plans P,..., --decode-drafter DIR, --decode-prompts FILE)" >&2; exit 2 ;;
  esac
  shift
done
if [ -n "$PAPER" ] && [ ! -f "$PAPER/nanochat/gpt.py" ]; then  # relative to the repository root, as --out
  echo "gpu_campaign: --paper $PAPER: no nanochat/gpt.py there (a checkout of the paper's code, nanochat-snlp)" >&2; exit 2
fi
if [ -z "$PAPER" ]; then
  for p in .paper/nanochat-snlp ../shared/anchors/nanochat-snlp; do [ -f "$p/nanochat/gpt.py" ] && PAPER=$p && break; done
fi
PY=python3
if [ "$QUICK" = 1 ]; then
  # one thread: torch before 2.13 (the lent machines' 2.11) corrupts the heap in its compiled CPU FlexAttention
  # kernel on two (docs/records/2026-11-27-torch-2.11-on-cpu.md), and the attn / flex parts call it directly
  export OMP_NUM_THREADS=1
  DEV=cpu; Q=--quick; T_SHORT=240; T_LONG=300
  ATTN="--device cpu --tokens 256 --window 64 --heads 2 --head-dim 32 --branches 4 --runs 3"
  PROF="--device cpu --quick --tokens 64"
  PROFC="--device cpu --quick --tokens 64 --shape 0.5B-nox0ve --plan 12xF2-h0-K1 --plan2 12xF2-h0-K2"
  PROFC_MODES=kernels  # no CUDA graphs on a CPU
  DEFAULT_PARTS=vs_paper_eager,attn,profile,vs_paper_compiled
  TRAIN_ARGS=""
else
  DEV=cuda; Q=""; T_SHORT=55; T_LONG=170
  ATTN="--device cuda"
  PROF="--device cuda --shape 0.5B --plan 24xF1-h0-K2 --plan2 24xF1-h0-K4"
  PROFC="--device cuda --shape 0.5B-nox0ve --plan 12xF2-h0-K1 --plan2 12xF2-h0-K2"
  PROFC_MODES="graphs kernels"
  DEFAULT_PARTS=vs_paper_eager,attn,profile,vs_paper_compiled
  TRAIN_ARGS="--train-batch 4 --train-steps 6 --train-warmup 2"
fi
PARTS=${PARTS:-$DEFAULT_PARTS}

# what a call asks for must be what it runs: an unknown part, a LIMIT_ / DECODE_ / TRAIN_ knob of no part (a typo) or
# of a part this call does not run, or a limit that is not whole seconds would be ignored, and a lent GPU's call spent
# on a table without the part it was for; refused here, before anything runs
ALL_PARTS=vs_paper_eager,attn,profile,profile_compiled,vs_paper_compiled,decode,decode_shape,decode_trained,host,flex
ALL_PARTS=$ALL_PARTS,flex_train,train  # every `part NAME` below (tests/bench/test_campaign.py checks)
refuse() { echo "gpu_campaign: $*" >&2; exit 2; }
has_part() { case ",$2," in *",$1,"*) return 0 ;; esac; return 1; }
[ -n "${PARTS//,/}" ] || refuse "--parts $PARTS names no part (the parts: $ALL_PARTS)"
for p in ${PARTS//,/ }; do
  has_part "$p" "$ALL_PARTS" || refuse "unknown part $p in --parts $PARTS (the parts: $ALL_PARTS)"
done
for v in $(compgen -e); do
  case "$v" in
    LIMIT_*) has_part "${v#LIMIT_}" "$ALL_PARTS" || refuse "$v names no part (the parts: $ALL_PARTS)"
             [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || refuse "$v=${!v}: a part's limit is whole seconds" ;;
    DECODE_BATCHES|DECODE_BLOCKS|DECODE_METHODS|DECODE_TREATMENTS|DECODE_PROMPTS)
             has_part decode "$PARTS" || refuse "$v sets the decode part's rows and this call runs no decode" \
                 "(parts $PARTS)" ;;
    TRAIN_REGS|TRAIN_TREATMENTS)
             has_part train "$PARTS" || refuse "$v sets the train part's variants and this call runs no train" \
                 "(parts $PARTS)" ;;
    TRAINED_STEPS)
             has_part decode_trained "$PARTS" || refuse "$v sets decode_trained's training and this call runs no" \
                 "decode_trained (parts $PARTS)" ;;
    DECODE_*|TRAIN_*|TRAINED_*)
             refuse "unknown knob $v (DECODE_BATCHES, DECODE_BLOCKS, DECODE_METHODS, DECODE_TREATMENTS," \
                 "DECODE_PROMPTS, TRAIN_REGS, TRAIN_TREATMENTS, TRAINED_STEPS)" ;;
  esac
done
if [ -n "$DFLAGS" ] && ! has_part decode "$PARTS"; then
  refuse "${DFLAGS# } set the decode part and this call runs no decode (parts $PARTS)"
fi
LOG="$OUT/log.txt"
# an output folder that cannot be written would lose every part's results after spending the call on them
{ mkdir -p "$OUT/parts" && : > "$LOG" && : > "$OUT/parts/.writable" && rm -f "$OUT/parts/.writable"; } 2>/dev/null ||
  refuse "--out $OUT: cannot write there"

# the machine, first: what the numbers below ran on
$PY - <<'EOF' 2>&1 | tee -a "$LOG"
import torch, platform
print("campaign: torch", torch.__version__, "cuda", torch.version.cuda, "python", platform.python_version())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("campaign: device", torch.cuda.get_device_name(), f"{p.total_memory / 2**30:.0f} GiB", p.multi_processor_count, "SMs")
EOF

# this call, as every status it writes names it: the table marks a status an earlier call into this --out left (a part
# this call did not run) as that call's
CALL="$(date -u +%Y-%m-%dT%H:%M:%SZ) pid $$"
outputs() {  # outputs NAME: what part NAME writes under $OUT/parts (besides NAME.status.json): every path its
  # command names
  case $1 in
    attn) echo attn.json ;;
    profile_compiled) echo profile_compiled_graphs profile_compiled_kernels ;;
    decode_trained) echo trained decode_trained ;;
    flex_train) echo flex_train_masked flex_train_flex ;;
    *) echo "$1" ;;
  esac
}
set_aside() {  # set_aside NAME: an earlier call's output of part NAME to $OUT/earlier/NAME/ (replacing an older
  # one there), so the table shows only what this call's run of it wrote: a failure, not the earlier call's success
  local name=$1 f moved=""
  for f in $(outputs "$name") "$name.status.json"; do
    [ -e "$OUT/parts/$f" ] || continue
    [ -n "$moved" ] || { rm -rf "$OUT/earlier/$name" && mkdir -p "$OUT/earlier/$name"; moved=1; }
    mv "$OUT/parts/$f" "$OUT/earlier/$name/"
  done
  [ -n "$moved" ] && echo "earlier/$name"
}
STOPPED=""; PART_PID=""  # the signal that stopped the campaign; the running part's process (timeout, its group leader)
stop() {  # a signal to the script: the running part's whole process group stops too (timeout runs it in a group of
  # its own, which a terminal's Ctrl-C does not reach, and a shell killed while it waits leaves it running), no part
  # starts after it, and the table of what finished is still written and printed
  STOPPED=$1
  echo "campaign: SIG$1: stopping${PART_PID:+ the running part (process group $PART_PID)}; no part runs after it" |
    tee -a "$LOG"
  stop_part
}
stop_part() {  # the running part's process group (timeout sends SIGKILL 10 s later); a part whose timeout has not made
  # its group yet (setpgid, its first step) is sent the signal alone, before it starts anything
  if [ -n "$PART_PID" ]; then kill -TERM -- "-$PART_PID" 2>/dev/null || kill -TERM "$PART_PID" 2>/dev/null; fi
}
trap 'stop INT' INT; trap 'stop TERM' TERM; trap 'stop HUP' HUP

part() {  # part NAME SECONDS CMD...: run one part under its limit; its status goes to the log
  local name=$1 secs=$2; shift 2
  local limit_var="LIMIT_$name"; secs=${!limit_var:-$secs}  # LIMIT_<part>=SECONDS overrides a part's limit
  case ",$PARTS," in *",$name,"*) ;; *) return 0 ;; esac
  local earlier
  earlier=$(set_aside "$name")
  if [ -n "$STOPPED" ]; then
    echo "campaign: part $name NOT RUN: the campaign was stopped by SIG$STOPPED" | tee -a "$LOG"
    echo "{\"part\": \"$name\", \"rc\": null, \"seconds\": 0," \
         "\"not_run\": \"the campaign was stopped by SIG$STOPPED\"," \
         "\"call\": \"$CALL\"${earlier:+, \"earlier\": \"$earlier\"}}" > "$OUT/parts/$name.status.json"
    return 0
  fi
  echo "campaign: part $name (limit ${secs}s) at $(date -u +%T)" | tee -a "$LOG"
  local t0=$SECONDS start rc
  start=$(stat -c %s "$LOG")
  # in the background, so a trapped signal runs `stop` at once (bash defers a trap until a foreground command ends);
  # `wait` returns early on each signal, so it is repeated until the part has exited
  timeout --kill-after=10 "$secs" "$@" >>"$LOG" 2>&1 &
  PART_PID=$!
  # a signal after the STOPPED check above (while the lines before this part's start ran) found no part to stop: it
  # is stopped now, not left to run to its limit
  if [ -n "$STOPPED" ]; then stop_part; fi
  while :; do
    wait "$PART_PID"; rc=$?
    kill -0 "$PART_PID" 2>/dev/null || break
  done
  PART_PID=""
  echo "campaign: part $name rc=$rc in $((SECONDS - t0))s" | tee -a "$LOG"
  # a failed part's last line of output (its error) goes into its status: the table, which a device call returns,
  # then says why, not only the exit status
  tail -c +$((start + 1)) "$LOG" | grep -Ev '^campaign: (part |SIG)' | grep -v '^[[:space:]]*$' | tail -n 1 |
    cut -c1-300 |
    $PY -c 'import json, sys; print(json.dumps({"part": sys.argv[1], "rc": int(sys.argv[2]), "seconds": int(sys.argv[3]),
             **({"last_line": sys.stdin.read().strip()} if sys.argv[2] != "0" else {}),
             **({"stopped": "SIG" + sys.argv[4]} if sys.argv[4] else {}), "call": sys.argv[5],
             **({"earlier": sys.argv[6]} if sys.argv[6] else {})}))' \
      "$name" "$rc" "$((SECONDS - t0))" "$STOPPED" "$CALL" "$earlier" > "$OUT/parts/$name.status.json"
}

PAPER_PARTS=vs_paper_eager,profile,profile_compiled,vs_paper_compiled  # the parts that run the paper's code
if [ -z "$PAPER" ]; then  # each asked-for one is named, in the log and the table, and the other parts still run
  for p in ${PARTS//,/ }; do
    has_part "$p" "$PAPER_PARTS" || continue
    earlier=$(set_aside "$p")
    echo "campaign: part $p NOT RUN: no checkout of the paper's code (--paper PATH, .paper/nanochat-snlp)" | tee -a "$LOG"
    echo "{\"part\": \"$p\", \"rc\": null, \"seconds\": 0, \"not_run\": \"no checkout of the paper's code\"," \
         "\"call\": \"$CALL\"${earlier:+, \"earlier\": \"$earlier\"}}" > "$OUT/parts/$p.status.json"
  done
fi
if [ -n "$PAPER" ]; then
  # 1. snlp vs the paper's code, eager, the three 0.5B shapes, with the baseline ablations
  part vs_paper_eager $T_LONG $PY -m snlp bench --vs-paper "$PAPER" $Q --device $DEV --treatments eager \
      --out "$OUT/parts/vs_paper_eager"
fi
# 2. which attention kernel pays for a sliding window only (single layer, 24-branch stack)
part attn $T_SHORT $PY scripts/attn_windows.py $ATTN --json "$OUT/parts/attn.json"
if [ -n "$PAPER" ]; then
  # 3. one call of each side profiled: kernel counts and where the device time goes (K=2 and K=4: one more iteration)
  part profile $T_SHORT $PY scripts/profile_prefill.py --paper "$PAPER" $PROF --out "$OUT/parts/profile"
  # 3b. (--parts profile_compiled) snlp's compiled 12xF2-h0-K0 / -K1 / -K2, with CUDA graphs (as timed) and without
  #     (every kernel by name): what the K = 1 plan pays once beyond one evaluation of its stack and beyond K = 0
  #     (the compiled sequential forward too, for its host gap and t(K = 0)'s share: docs/records/2026-11-28-prefill-once.md)
  part profile_compiled $((T_LONG + 130)) bash -c "for m in $PROFC_MODES; do $PY scripts/profile_prefill.py --paper '$PAPER' \
      $PROFC --compiled \$m --out '$OUT/parts/profile_compiled_'\$m || exit 1; done"
  # 4. compiled (CUDA graphs) snlp beside eager snlp and the paper, one shape
  part vs_paper_compiled $T_LONG $PY -m snlp bench --vs-paper "$PAPER" $Q --device $DEV --shapes 0.5B-nox0ve \
      --treatments eager,compiled --no-ablations --out "$OUT/parts/vs_paper_compiled"
fi

# 5. (--parts decode,decode_shape) the decode suite: snlp's decoders against transformers' on one model (--decode-ckpt,
#    DECODE_BATCHES=1 for batch 1 only, DECODE_BLOCKS=4,8 for the draft blocks, DECODE_METHODS=speculative and
#    DECODE_TREATMENTS=compiled to run only the rows the speedup compares (snlp sequential always runs),
#    DECODE_PROMPTS=8 for calls that decode 8 prompts each, a batch at a time (alpha over more than one prompt);
#    default random weights at SmolLM2-135M's shape: its GGUF is over a device call's 64 MiB), and the random-weights
#    0.5B drafter step times with a PREDICTED speedup
part decode $((T_LONG + 70)) $PY -m snlp bench --suite decode $Q --device $DEV --ckpt "$DCKPT" \
    ${DPLANS:+--suite-plans "$DPLANS"} ${DDRAFTER:+--drafter "$DDRAFTER"} ${DPROMPTS:+--prompts-file "$DPROMPTS"} \
    --batch-sizes "${DECODE_BATCHES:-1,4}" \
    ${DECODE_BLOCKS:+--blocks "$DECODE_BLOCKS"} ${DECODE_METHODS:+--suite-methods "$DECODE_METHODS"} \
    ${DECODE_TREATMENTS:+--treatments "$DECODE_TREATMENTS"} ${DECODE_PROMPTS:+--suite-prompts "$DECODE_PROMPTS"} \
    --suite-new-tokens 64 --suite-warmup 2 --suite-runs 5 \
    --out "$OUT/parts/decode"
part decode_shape $T_LONG $PY -m snlp bench --suite decode $Q --device $DEV --shapes 0.5B --suite-plans 24xF1-h0-K2 \
    --alpha 0.5,0.7,0.9 --out "$OUT/parts/decode_shape"

# 5b. (--parts decode_trained) the speedrun-shaped IDN-Reg model (depth 16, width 128, N = 12) trained here for a few
#     hundred steps, then the decode suite on it: measured acceptance, tokens/s of every decoder, same prompts
if [ "$QUICK" = 1 ]; then TRAINED="--depth 4 --width 64 --steps 3 --reg-n 2 --seq-len 64"; DPLAN=2xF1-h0-K1
else TRAINED="--depth 16 --width 128 --steps ${TRAINED_STEPS:-300} --reg-n 12 --seq-len 256"; DPLAN=12xF1-h0-K1; fi
part decode_trained $T_LONG bash -c "$PY -m snlp train --out '$OUT/parts/trained' $TRAINED --head-dim 32 --vocab-size 4096 \
    --batch-size 8 --reg idn --device $DEV --no-progress --max-chars 2000000 && $PY -m snlp bench --suite decode $Q \
    --device $DEV --ckpt '$OUT/parts/trained' --suite-plans $DPLAN --batch-sizes 1,4 --suite-new-tokens 64 \
    --suite-warmup 2 --suite-runs 5 --out '$OUT/parts/decode_trained'"

# 5d. (--parts host) the host time of one compiled call, split (dynamo's guard check, the Step's own Python, the graph
#     call; each decode Step also with the guard cut, snlp.decode.steps.StepState, and its snapshot alone), beside the
#     time until the device finished it: whether compiled prefill and decode steps are host-bound
#     (scripts/host_per_call.py; docs/records/2026-11-28-host-per-call.md), at the speedrun model's shape
if [ "$QUICK" = 1 ]; then HOST="--depth 2 --width 32 --plan 1xF1-h0-K1 --block 2 --rounds 5"
else HOST="--depth 16 --width 128 --head-dim 32 --plan 16xF1-h0-K3 --block 4 --rounds 200"; fi
part host $T_LONG $PY scripts/host_per_call.py $HOST --device $DEV --out "$OUT/parts/host"

# 5c. (--parts flex) the FlexAttention window kernel inside compiled prefill: 0.5B-nox0ve (SSSL, window 512), its
#     sequential forward, 12xF2-h0-K1 and 12xF2-h0-K2, each compiled (CUDA graphs) with the masked and the flex kernel,
#     round-robin in one process (scripts/flex_windows.py prefill); (--parts flex_train) one compiled training step of
#     the same shape per kernel (SNLP_WINDOW_ATTENTION: masked, then flex)
if [ "$QUICK" = 1 ]; then FLEX_TRAIN="--train-batch 2 --train-steps 1 --train-warmup 1"
else FLEX_TRAIN="--train-batch 4 --train-steps 4 --train-warmup 1"; fi
part flex $((T_LONG + 130)) $PY scripts/flex_windows.py prefill $Q --device $DEV --out "$OUT/parts/flex"
part flex_train $((T_LONG + 70)) bash -c "for k in masked flex; do SNLP_WINDOW_ATTENTION=\$k $PY -m snlp bench --suite train $Q \
    --device $DEV --shapes 0.5B-nox0ve --treatments compiled --regs none $FLEX_TRAIN --out '$OUT/parts/flex_train_'\$k \
    || exit 1; done"

# 6. (--parts train) training step speed at the 0.5B shape: eager vs compiled, plain vs --reg idn --reg-n 24
#    (the --reg-rows variant, --regs none,idn,idn:0.25, is left out by default: the four variants here already ran
#    past the part's limit on the H200, docs/records/gpu-2026-11-26-h200-call2; TRAIN_REGS=none,idn:0.25
#    TRAIN_TREATMENTS=eager times the regulariser's overhead alone in one short call)
part train $T_LONG $PY -m snlp bench --suite train $Q --device $DEV --shapes 0.5B ${TRAIN_ARGS:-} \
    ${TRAIN_REGS:+--regs "$TRAIN_REGS"} ${TRAIN_TREATMENTS:+--treatments "$TRAIN_TREATMENTS"} --out "$OUT/parts/train"

# the table, last (a stopped campaign's too: what finished before the signal)
$PY scripts/campaign_table.py "$OUT" "$CALL"
rc=$?
case $STOPPED in INT) exit 130 ;; TERM) exit 143 ;; HUP) exit 129 ;; esac
exit $rc
