#!/usr/bin/env bash
# Second call of 2026-11-27: why kerple_log's compiled fit compiled 15 frames in its warm-up with 5 graph breaks, and t5's fit.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false TORCH_LOGS="recompiles,graph_breaks"
timeout -k 5 215 python3 -m cable_lightning gpu-check --data-path data/pydocs-bpe4096 --out $OUT/gc5.md \
    --runs-dir /tmp/r5 --encodings kerple_log t5 > $OUT/gc5-console.txt 2>&1
echo "rc $?"; grep '^\[gpu-check\] |' $OUT/gc5-console.txt | cut -c1-330; grep -c -i "recompil" $OUT/gc5-console.txt
