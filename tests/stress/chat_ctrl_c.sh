#!/bin/bash
# The Ctrl-C proof of `pdserve chat` (it must pass 50 of 50 runs with a CPU hog beside it):
# runs tests/integration/test_cli_chat_pty.py N times (default 50) while `python -c 'while 1:
# pass'` keeps a core busy, and prints pass/fail counts; each run's output goes to $LOGS/run_I.log.
# Usage (repository root): tests/stress/chat_ctrl_c.sh [N]   (PYTHON=... to pick the interpreter)
set -u
N=${1:-50}
PYTHON=${PYTHON:-.venv/bin/python}
LOGS=${LOGS:-$(mktemp -d /tmp/chat-ctrl-c.XXXXXX)}
export PYTHONPATH=$PWD/src
python3 -c 'while 1: pass' &
HOG=$!
trap 'kill $HOG' EXIT
pass=0
fail=0
for i in $(seq 1 "$N"); do
  if timeout 900 "$PYTHON" -m pytest tests/integration/test_cli_chat_pty.py -q -p no:cacheprovider \
      > "$LOGS/run_$i.log" 2>&1; then
    pass=$((pass + 1))
  else
    fail=$((fail + 1))
    echo "run $i failed: $LOGS/run_$i.log"
  fi
done
echo "pass=$pass fail=$fail (logs in $LOGS)"
