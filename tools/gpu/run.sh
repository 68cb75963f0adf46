#!/usr/bin/env bash
# The paper's experiment at a GPU's scale on one CUDA machine (tools/gpu/README.md):
# configs/paper/gpt2_small_code.yaml, one encoding after another, in the minutes one call gives. Parts, in order, each
# under its own `timeout` inside a total cap, each writing its line to $OUT/results.jsonl as it finishes (a part cut
# short keeps what finished before):
#   env        the device, torch, and every package the runs import (installed, or from wheels in .whl/)
#   gpu-check  (GPU_CHECK=1 only) `gpu-check` on GC_ENCODINGS
#   prepare    `prepare --source python-code --tokenizer bpe:16384 --num_workers 16` into $DATA, unless it was carried
#   fit X      for each of ENCODINGS: `fit --config configs/paper/gpt2_small_code.yaml --config
#              configs/trainer/single.yaml --model.init_args.backbone.pos_encoding X`, started only when its planned
#              seconds (PLAN_S) are left, its timeout the minutes left; then its line (perplexity at each length,
#              ppl(16x)/ppl(1x), tokens trained, steady tokens/s, MFU, machine, corpus hash) and every run's records
#              again in $OUT/records.tar.gz (no checkpoints)
#   report     `report` over the runs into $OUT/report.md (and the whole report in records.tar.gz)
# $OUT gets at most 7 files (the device tool returns 8): results.jsonl, run-log.txt, manifest.json, records.tar.gz,
# report.md, and with GPU_CHECK=1 gpu_check.md and gpu_check-console.txt. A part with no second left of the cap is
# not started (`timeout 0` would mean no limit). Stopped by SIGTERM or Ctrl-C, the script stops its running part
# (`timeout` leads a process group of its own and passes SIGTERM to all of it: a fit saves last.ckpt and stops),
# removes its work folder and exits with 128 + the signal; what $OUT holds by then stays.
#
# On the CUDA machine, from the project root (wheels of missing packages, if any, in .whl/ or $WHL):
#     OUT=/tmp/gpu-out bash tools/gpu/run.sh
# CPU rehearsal at toy sizes (every part, seconds; tests/test_gpu_run.py runs it):
#     REHEARSE=1 OUT=/tmp/out PY=$(which python) bash tools/gpu/run.sh
#
# Knobs (environment): ENCODINGS (default: cable alibi kerple_log rope nope t5 fire), TOTAL_S (the cap, 575 s: fits a
# 600 s time limit with 25 s kept for a part's kill and the last copy),
# REPORT_S (the seconds kept for the report and the last copy: 20, 60 in a rehearsal), GPU_CHECK (0; 1 runs
# gpu-check first), GC_ENCODINGS, GC_SHAPES (gpu-check's --shapes: gpt2-vocab, the paper's
# vocabulary, alone by default, as both shapes of gpu-check's default plan do not fit one call), SOURCE (python-code, or a slice python-code:NAME,...) and DATA
# (the prepared corpus, data/pycode-bpe16384), RUNS (the runs, outside $OUT), SITE (where the wheels go), PY.
set -uo pipefail

REHEARSE=${REHEARSE:-0}
PY=${PY:-python3}
if [ "$REHEARSE" = 1 ]; then
    OUT=${OUT:-$(mktemp -d -t gpu-run-out.XXXXXX)}
else
    : "${OUT:?OUT must name the folder whose files come back}"
fi
WORK=$(mktemp -d -t gpu-run-work.XXXXXX)
SITE=${SITE:-$WORK/site}
RUNS=${RUNS:-$WORK/runs}
ENCODINGS=${ENCODINGS:-cable alibi kerple_log rope nope t5 fire}
GPU_CHECK=${GPU_CHECK:-0}
GC_ENCODINGS=${GC_ENCODINGS:-nope kerple_log t5 cope}
GC_SHAPES=${GC_SHAPES:-gpt2-vocab}
CONFIG=(--config configs/paper/gpt2_small_code.yaml --config configs/trainer/single.yaml)
RESULTS=$OUT/results.jsonl
if [ "$REHEARSE" = 1 ]; then
    # the rehearsal's report was cut at 15 s in a CI run on a 2-core VM busy with two training runs
    REPORT_S=${REPORT_S:-60}
    # toy sizes on the CPU: proves the script's commands and files, not a figure. A slice of two small distributions
    # of the lock's environment (rfc3339-validator is held out: validation), a 300-token BPE, a 2-layer model.
    TOTAL_S=${TOTAL_S:-600}
    DATA=${DATA:-$WORK/data/pycode-rehearsal}
    SOURCE=python-code:cycler,rfc3339-validator TOKENIZER=bpe:300
    FIT_ARGS=(--trainer.accelerator cpu --trainer.precision 32-true --model.init_args.compile false
         --model.init_args.backbone.n_layer 2 --model.init_args.backbone.n_head 2 --model.init_args.backbone.n_embd 32
         --data.block_size 32 --data.micro_batch_size 2 --global_batch_tokens 64 --data.num_workers 0
         --data.eval_lengths '[32, 64]' --data.eval_tokens 128 --trainer.max_steps 4 --model.init_args.warmup_steps 1
         --checkpoint.every_n_train_steps 4 --trainer.log_every_n_steps 1 --throughput.warmup 1
         --trainer.enable_progress_bar false --trainer.logger false)
    declare -A PLAN_S=()
    PLAN_DEFAULT=5
else
    TOTAL_S=${TOTAL_S:-575}
    REPORT_S=${REPORT_S:-20}  # kept for the report and the last copy of the records
    DATA=${DATA:-data/pycode-bpe16384}
    SOURCE=${SOURCE:-python-code} TOKENIZER=bpe:16384
    FIT_ARGS=(--trainer.enable_progress_bar false)
    # Planned seconds on one H100 (configs/paper/gpt2_small_code.yaml says how; not yet measured on a GPU)
    declare -A PLAN_S=([cable]=235 [alibi]=225 [kerple_log]=355 [rope]=205 [nope]=205 [t5]=355 [fire]=600)
    PLAN_DEFAULT=360
fi
mkdir -p "$OUT" "$RUNS"
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( TOTAL_S - $(elapsed) - REPORT_S )); }
el() { echo "=== $1 at +$(elapsed)s"; }
part() { "$PY" tools/gpu/parts.py --results "$RESULTS" "$@"; }
RUNNING=$WORK/running.pgid  # the process group of the part running now (`timeout` leads one of its own)

timed() {  # timed SECONDS KILL_AFTER COMMAND...: COMMAND under `timeout`, in a process group the script's stop ends
    local seconds=$1 kill_after=$2 pid rc
    shift 2
    if [ "$seconds" -lt 1 ]; then  # `timeout 0` means no limit
        echo "not started: no second left of the ${TOTAL_S}s cap"
        return 124
    fi
    timeout -k "$kill_after" "$seconds" "$@" &
    pid=$!
    echo "$pid" > "$RUNNING"
    wait "$pid"
    rc=$?
    rm -f "$RUNNING"
    return "$rc"
}

records() {  # every run's records (no checkpoints) and the report so far, into one file that comes back
    tar -czf "$OUT/records.tar.gz.partial" -C "$WORK" --exclude='*.ckpt' --exclude='checkpoints' \
        "$(basename "$RUNS")" $([ -d "$WORK/report" ] && echo report) 2>/dev/null \
        && mv "$OUT/records.tar.gz.partial" "$OUT/records.tar.gz"
}

wheels() {
    local whl=""
    for d in "${WHL:-}" .whl; do
        if [ -n "$d" ] && compgen -G "$d/*.whl" >/dev/null; then whl=$d; break; fi
    done
    if [ -z "$whl" ]; then
        echo "no wheels (.whl/*.whl): the packages the image lacks will not import there"
        return
    fi
    # The device's Python is 3.12, the wheels' (multiprocess ships one per Python); on another Python (a rehearsal)
    # they are installed as for 3.12, to prove they install, and left off the path
    local as312=()
    "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' || as312=(--python-version 3.12
        --implementation cp --only-binary=:all:)
    timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        "${as312[@]}" --target "$SITE" "$whl"/*.whl && echo "$(ls "$whl"/*.whl | wc -l) wheels from $whl into $SITE" \
        || echo "WHEELS FAILED (rc $?)"
    [ ${#as312[@]} -gt 0 ] && { echo "(not Python 3.12: the wheels stay off PYTHONPATH)"; SITE=$WORK/none; }
}

main() {
    el "start (rehearse $REHEARSE, python $PY, total cap ${TOTAL_S}s, encodings: $ENCODINGS)"
    git log --oneline -1 2>/dev/null || echo "(no git log: the copy has no .git; its commit is the caller's)"
    wheels
    export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
    local t0 rc t

    el "env"
    command -v nvidia-smi >/dev/null && timeout 20 nvidia-smi \
        --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    timed 120 10 "$PY" tools/gpu/parts.py --results "$RESULTS" env $([ "$REHEARSE" = 1 ] && echo --rehearse) \
        || { echo "IMPORTS FAILED: nothing else can run"; return 1; }

    el "gpu-check"
    if [ "$GPU_CHECK" = 1 ] && [ "$(left)" -lt 1 ]; then
        part line part=gpu-check status=skipped "note=no second left of the ${TOTAL_S}s cap"
    elif [ "$GPU_CHECK" = 1 ]; then
        t=$(left); t0=$(date +%s)
        # shellcheck disable=SC2086
        timed "$t" 20 "$PY" -m cable_lightning gpu-check $([ "$REHEARSE" = 1 ] && echo --rehearse_on_cpu) \
            --out "$OUT/gpu_check.md" --runs_dir "$WORK/gpu_check" --encodings $GC_ENCODINGS --shapes $GC_SHAPES \
            > "$OUT/gpu_check-console.txt" 2>&1
        rc=$?
        grep -E '^\[gpu-check\] \||^error' "$OUT/gpu_check-console.txt" | cut -c1-300
        part line part=gpu-check "status=rc $rc" "encodings=$GC_ENCODINGS" "wall_s=$(( $(date +%s) - t0 ))"
    else
        part line part=gpu-check status=skipped "note=off (GPU_CHECK=1 runs it first)"
    fi

    el "prepare"
    t0=$(date +%s)
    if [ -f "$DATA/manifest.json" ]; then
        echo "$DATA is here (carried, or prepared by an earlier call on this machine): not prepared again"
        part prepared "$DATA" --status found --seconds 0
    elif [ "$(left)" -lt 1 ]; then
        part line part=prepare status=skipped "note=no second left of the ${TOTAL_S}s cap"
        return 1
    else
        timed "$(left)" 20 "$PY" -m cable_lightning prepare --source "$SOURCE" --tokenizer "$TOKENIZER" \
            --num_workers 16 --out "$DATA" 2>&1 | grep -v -E '^source python-code: skipping'
        rc=${PIPESTATUS[0]}
        if [ "$rc" != 0 ] || [ ! -f "$DATA/manifest.json" ]; then
            part line part=prepare "status=failed rc $rc" "wall_s=$(( $(date +%s) - t0 ))"
            return 1
        fi
        part prepared "$DATA" --seconds $(( $(date +%s) - t0 ))
    fi
    cp "$DATA/manifest.json" "$OUT/manifest.json"

    local pe plan status
    for pe in $ENCODINGS; do
        el "fit $pe"
        plan=${PLAN_S[$pe]:-$PLAN_DEFAULT}
        t=$(left)
        if [ "$t" -lt "$plan" ]; then
            echo "skipped: ${t}s left, ${plan}s planned"
            part line part=fit "pe=$pe" status=skipped "note=${t}s left of the cap, ${plan}s planned"
            continue
        fi
        t0=$(date +%s)
        timed "$t" 10 "$PY" -m cable_lightning fit "${CONFIG[@]}" --model.init_args.backbone.pos_encoding "$pe" \
            --data.path "$DATA" --runs_dir "$RUNS/$pe" --trainer.default_root_dir "$RUNS/$pe" "${FIT_ARGS[@]}" 2>&1 \
            | grep -v -E 'UserWarning|warnings.warn|^\s*$'
        rc=${PIPESTATUS[0]}
        case $rc in
            0) status=done ;;
            124|137) status="timed out after ${t}s" ;;
            *) status="failed rc $rc" ;;
        esac
        part fit "$pe" "$RUNS/$pe" --status "$status" --seconds $(( $(date +%s) - t0 ))
        records
    done

    el "report"
    t0=$(date +%s)
    mkdir -p "$WORK/report"
    timed $(( REPORT_S - 5 )) 10 "$PY" -m cable_lightning report "$RUNS" --out "$WORK/report/report" \
        > "$WORK/report/console.txt" 2>&1
    rc=$?
    tail -n 3 "$WORK/report/console.txt"
    for f in "$WORK"/report/*.md; do
        [ -f "$f" ] && { echo "## $(basename "$f" .md)"; echo; cat "$f"; echo; }
    done > "$OUT/report.md"
    [ "$rc" = 0 ] || { echo "## report failed (rc $rc)"; tail -n 5 "$WORK/report/console.txt"; } >> "$OUT/report.md"
    part line part=report "status=$([ "$rc" = 0 ] && echo done || echo "failed rc $rc")" \
        "wall_s=$(( $(date +%s) - t0 ))"
    records
    el "done"
    ls -la "$OUT"
}

stop() {  # SIGTERM or Ctrl-C: no next part, the running one's process group stopped, the work folder removed
    local signum=$1 group i
    trap '' TERM INT
    echo "=== stopped by signal $signum at +$(elapsed)s: stopping the running part" >> "$OUT/run-log.txt"
    kill -TERM "$MAIN" 2>/dev/null  # main's shell: it starts nothing more
    group=$(cat "$RUNNING" 2>/dev/null)
    if [ -n "$group" ]; then
        kill -TERM "$group" 2>/dev/null  # timeout passes it to its whole group, as when its time is up
        for i in $(seq 1 100); do  # a fit saves last.ckpt first: at most 20 s, then it is killed
            kill -0 -- "-$group" 2>/dev/null || break
            [ "$i" = 100 ] && kill -KILL -- "-$group" 2>/dev/null
            sleep 0.2
        done
    fi
    wait
    rm -rf "$WORK"
    exit $(( 128 + signum ))
}

# main runs in the background, so that a signal is taken at once (bash runs a trap only after a foreground job ends)
main > >(tee -a "$OUT/run-log.txt") 2>&1 &
MAIN=$!
trap 'stop 15' TERM
trap 'stop 2' INT
wait "$MAIN"
rc=$?
trap - TERM INT
wait  # tee's last lines
rm -rf "$WORK"
exit "$rc"
