# on the device: bash .whl/probe.sh (OUT set); REHEARSE=1 PY=... on CPU
PY=${PY:-python3}
if [ "${REHEARSE:-0}" != 1 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 60 $PY .whl/flexprobe.py default 2>&1 | grep '^{'
timeout 70 $PY .whl/flexprobe.py opts 2>&1 | grep '^{'
timeout 70 $PY .whl/flexprobe.py small 2>&1 | grep '^{'
timeout 40 $PY .whl/flexprobe.py nope 2>&1 | grep '^{'
echo "done at +$(( $(date +%s) - T0 ))s"
