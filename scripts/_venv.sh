# Sourced by scripts/*: create .venv if missing and install fdecode (with test extras) into it.
# Re-installs only when pyproject.toml changed since the last install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[fdecode] creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.fdecode-installed"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
  echo "[fdecode] installing fdecode[test] into $VENV" >&2
  "$VENV/bin/python" -m pip install -q --upgrade pip >&2
  "$VENV/bin/python" -m pip install -q -e "$ROOT[test]" >&2
  touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
